"""The hostile corpus (issue 7 acceptance): 0 bytes written outside, 0 secrets leaked,
0 connections, 0 processes alive 1 s after each run, exactly one verdict within wall + 1 s.

All programs run once, four at a time, in a module fixture; the tests then read the outcomes.
``test_controls.py`` shows that each of these checks does fire when the jail is off."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttrain.rewards.sandbox import CaseResult, Sandbox, Verdict

from .conftest import LIMITS, descendants, processes_with, require_bwrap
from .hostile import HOSTILE
from .hostile_exhaustion import FORK_BOMBS

pytestmark = pytest.mark.slow
NOT_PASSING = {"fail", "crash", "timeout", "memory"}


def fill(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace(key, value)
    assert "@" not in template.replace("@property", ""), f"unfilled placeholder in {template!r}"
    return template


def pwned_paths(canary_dir: Path) -> list[Path]:
    prefix = Path(os.path.realpath(sys.base_prefix))
    places = ["/tmp", "/root", Path.home(), os.getcwd(), canary_dir, "/etc", "/usr", "/usr/lib", "/var/tmp", "/"]
    places += ["/dev", "/dev/shm", "/opt", "/work", prefix / "lib"]
    return [Path(p) / "posttrain-pwned" for p in places]


@dataclass
class Outcome:
    result: CaseResult
    seconds: float  # from the call to its verdict
    alive: list[str]  # processes carrying the run's label 1 s after the verdict


def unbounded() -> bool:
    """Root without a writable pids cgroup: nothing bounds a fork bomb's task count but the
    wall time (the sandbox says so at start-up), and on a host with the default pid_max of
    32768 a 2 s bomb can exhaust the pids of the whole machine. Those programs are skipped."""
    return Sandbox(LIMITS).containment.startswith("pid namespace")


def running(pids: list[int]) -> set[tuple[int, str]]:
    """``pids`` still alive, each with its start time (a pid the system reuses is a new process)."""
    alive = set()
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            alive.add((pid, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))
    return alive


@pytest.fixture(scope="module")
def earlier_processes() -> set[tuple[int, str]]:
    """This test process's children from before the corpus: an earlier test in the same process
    (pytest-xdist runs many in one) may leave long-lived helpers, such as the resource tracker
    multiprocessing starts with a spawn-context lock or Inductor's compile workers."""
    return running(descendants())


@pytest.fixture(scope="module")
def outcomes(canaries, earlier_processes) -> dict[str, Outcome]:
    require_bwrap()
    assert not [p for p in pwned_paths(canaries.canary_dir) if p.exists()], "remove the leftovers of an earlier run"
    run_id = secrets.token_hex(4)
    skipped = FORK_BOMBS if unbounded() else set()
    names = [name for name in HOSTILE if name not in skipped]

    def run(name: str) -> tuple[str, Outcome]:
        label = f"posttrain-hostile-{run_id}-{name}"
        source = fill(HOSTILE[name][0], canaries.placeholders(label))
        box = Sandbox(LIMITS, label=label)
        start = time.monotonic()
        result = box.run_io(source, "", "posttrain-never-printed")
        seconds = time.monotonic() - start
        time.sleep(1.0)
        return name, Outcome(result, seconds, processes_with(label))

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(run, names))


def test_the_corpus_is_large_enough_and_compiles():
    assert len(HOSTILE) >= 60
    for name, (source, _) in HOSTILE.items():
        compile(source.replace("@PORT@", "1"), name, "exec")  # a program that does not compile tests nothing


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(name, outcomes, canaries):
    if name not in outcomes:
        pytest.skip("no writable pids cgroup and running as root: fork bombs are bounded only by the wall time")
    outcome = outcomes[name]
    result = outcome.result
    allowed = HOSTILE[name][1] or NOT_PASSING
    assert result.verdict.value in allowed, f"{name}: {result.verdict.value} ({result.detail})"
    assert result.verdict is not Verdict.INFRA_ERROR
    assert outcome.seconds <= LIMITS.wall_s + 1.0, f"{name}: verdict after {outcome.seconds:.2f} s"
    assert outcome.alive == [], f"{name}: processes alive 1 s after the run: {outcome.alive}"
    seen = result.stdout + result.stderr + result.detail.encode()
    assert canaries.secret.encode() not in seen, f"{name} leaked the secret"
    assert b"CONNECTED" not in result.stdout and b"RESOLVED" not in result.stdout
    assert b"FOUND" not in result.stdout and b"CHANGED" not in result.stdout
    # inside the jail only its private /tmp and /dev/shm take writes
    wrote = [line for line in result.stdout.splitlines() if line.startswith(b"WROTE ")]
    assert all(line[6:].startswith((b"/tmp/", b"/dev/shm/")) for line in wrote), wrote


def test_nothing_was_written_outside(outcomes, canaries):
    written = [str(p) for p in pwned_paths(canaries.canary_dir) if p.exists()]
    assert written == []
    assert canaries.directory_state() == canaries.snapshot  # same names, bytes and mtimes
    stdlib = Path(os.__file__)
    assert b"pwned" not in stdlib.read_bytes()[-100:]


def test_no_connection_reached_the_host(outcomes, canaries):
    time.sleep(0.2)  # let the accept threads record anything in flight
    assert canaries.listener.hits == []


def test_no_process_outlives_the_corpus(outcomes, earlier_processes):
    assert running(descendants()) - earlier_processes == set()
