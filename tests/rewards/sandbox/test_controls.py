"""Positive controls: with the jail off (``unsafe_local``) the corpus's detectors do fire, so
their silence in ``test_hostile.py`` means something. Each control is one hostile program."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time

import pytest

from posttrain.rewards.sandbox import Sandbox

from .conftest import LIMITS, Listener, processes_with
from .hostile import HOSTILE

pytestmark = pytest.mark.slow


@pytest.fixture
def unjailed() -> Sandbox:
    with pytest.warns(RuntimeWarning, match="WITHOUT a jail"):
        box = Sandbox(LIMITS, unsafe_local=True)
        box.check()
    return box


def test_the_listener_counts_a_connection_from_an_unjailed_program(unjailed, tmp_path):
    listener = Listener(0, f"posttrain-control-{secrets.token_hex(4)}", str(tmp_path / "s.sock"))
    listener.serve()
    try:
        source = HOSTILE["tcp_loopback"][0].replace("@PORT@", str(listener.port))
        result = unjailed.run_io(source, "", "-")
        time.sleep(0.2)
        assert b"CONNECTED" in result.stdout and listener.hits
    finally:
        listener.close()


def test_the_secret_check_sees_a_home_file_read_without_the_jail(unjailed, canaries):
    source = HOSTILE["home_secret_file"][0].replace("@SECRET_FILE@", str(canaries.home_file))
    source = source.replace("@HOME@", str(canaries.home_file.parent))
    result = unjailed.run_io(source, "", "-")
    assert canaries.secret.encode() in result.stdout
    # the environment is cleared even without the jail
    env = unjailed.run_io(HOSTILE["environment"][0].replace("@SECRET_ENV@", canaries.env_name), "", "-")
    assert canaries.secret.encode() not in env.stdout


def test_the_write_check_sees_a_write_without_the_jail(unjailed, tmp_path):
    source = HOSTILE["write_canary_dir"][0].replace("@CANARY_DIR@", str(tmp_path))
    unjailed.run_io(source, "", "-")
    assert (tmp_path / "posttrain-pwned").exists()


def test_the_process_check_sees_a_daemon_that_escaped(tmp_path):
    label = f"posttrain-control-{secrets.token_hex(4)}"
    with pytest.warns(RuntimeWarning):
        box = Sandbox(LIMITS, unsafe_local=True, label=label)
        box.check()
    box.cgroups = None  # neither a pid namespace nor a cgroup: a setsid daemon outlives the run
    box.run_io(HOSTILE["double_fork_daemon"][0].replace("@LABEL@", label), "", "-")
    time.sleep(1.0)
    survivors = processes_with(label)
    for line in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert survivors
