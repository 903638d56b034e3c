"""Correct programs under parallel load (issue 23, item 0): 0 infra errors and 0 wrong verdicts,
however slowly the machine's init reaps the jails' inits, and the process cap of each run stays
its own (a run gets the same number of forks after a thousand runs as on a fresh sandbox).

The load runs in a child process that makes itself the subreaper of the jails (see
``reaper_load.py``), so the slow or absent reaping that broke main's CI on a firecracker VM is
reproduced on any machine with a writable pids cgroup."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from posttrain.rewards.sandbox import Sandbox

from .conftest import LIMITS, require_bwrap
from .reaper_load import forks_allowed

pytestmark = pytest.mark.slow


def run_load(runs: int, reap_every_s: float, max_kept: int | None = None) -> dict:
    argv = [sys.executable, "-m", "tests.rewards.sandbox.reaper_load", str(runs), str(reap_every_s)]
    if max_kept is not None:
        argv.append(str(max_kept))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


@pytest.fixture(scope="module")
def fresh_cap() -> int:
    require_bwrap()
    box = Sandbox(LIMITS)
    if box.cgroups is None:
        pytest.skip(f"no writable pids cgroup here ({box.containment}): no per-run cap to exhaust")
    forks = forks_allowed(box)
    assert 0 < forks <= LIMITS.max_processes + 4
    return forks


def test_a_thousand_concurrent_runs_pass_while_the_jail_inits_are_reaped_seconds_late(fresh_cap):
    report = run_load(1000, reap_every_s=3.0)
    assert report["verdicts"] == {"pass": 1000}, report
    assert report["forks_allowed"] == fresh_cap, report


def test_runs_pass_and_keep_their_cap_when_the_jail_inits_are_never_reaped(fresh_cap):
    # a pool of 16 cgroups, all charged with zombies after 16 runs: the rest reuse them
    report = run_load(300, reap_every_s=0, max_kept=16)
    assert report["verdicts"] == {"pass": 300}, report
    assert report["unreaped_at_end"] >= 300  # nothing reaped them: every cgroup reused was charged
    assert report["forks_allowed"] == fresh_cap, report
    assert "run cgroups all still hold unreaped processes" in report["stderr"]
