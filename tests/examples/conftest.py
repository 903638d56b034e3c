"""Every example's runs, checked after its test: the reward-hacking alarm (rewards/hacking_alarm.py)
fires only where a test module expects it (``ALARMS_EXPECTED``: the run folders that raise it,
e.g. the RLHF example's β = 0 run); every other run of every example stays silent.

The examples run with :data:`EXAMPLE_THREADS` torch thread whatever the machine or the test
runner: their learning outcomes depend on float rounding, which depends on the thread count and
the CPU, and their thresholds were measured at one thread (``make test`` gives each test one).
On a given CPU and thread count a run repeats bit for bit (the shared-prompt backward that did
not, at two threads: tests/models/test_logprobs.py); on another CPU it may sample other answers
after some steps, which the thresholds leave room for (tests/examples/test_rlhf.py says how much)."""

from __future__ import annotations

import pytest
import torch

EXAMPLE_THREADS = 1


@pytest.fixture(autouse=True)
def example_threads(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(EXAMPLE_THREADS))  # for any process an example starts
    torch.set_num_threads(EXAMPLE_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def the_alarm_fires_only_where_expected(request, tmp_path):
    yield
    fired = sorted(path.parent.name for path in tmp_path.rglob("alarm.json"))
    assert fired == sorted(getattr(request.module, "ALARMS_EXPECTED", [])), fired
