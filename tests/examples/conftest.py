"""Every example's runs, checked after its test: the reward-hacking alarm (train/hacking_alarm.py)
fires only where a test module expects it (``ALARMS_EXPECTED``: the run folders that raise it,
e.g. the RLHF example's β = 0 run); every other run of every example stays silent.

The examples run with :data:`EXAMPLE_THREADS` torch threads whatever the machine or the test
runner (``make test`` gives each test one): their learning outcomes depend on float rounding,
which depends on the thread count, and their thresholds were measured at two (the RLHF
example's β = 0 reward-model rise was 1.96 with one thread against the 2.0 it asserts)."""

from __future__ import annotations

import pytest
import torch

EXAMPLE_THREADS = 2


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
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
