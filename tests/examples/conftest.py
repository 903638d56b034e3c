"""Every example's runs, checked after its test: the reward-hacking alarm (train/hacking_alarm.py)
fires only where a test module expects it (``ALARMS_EXPECTED``: the run folders that raise it,
e.g. the RLHF example's β = 0 run); every other run of every example stays silent.

The examples run with :data:`EXAMPLE_THREADS` torch thread whatever the machine or the test
runner: their learning outcomes depend on float rounding, which depends on the thread count. With
one thread a run is bit-reproducible on a given CPU (the same seed twice gave the same weights);
with two the RL update is not: two runs of the RLHF example's PPO stage from identical rollouts
and advantages ended their first step with weights up to 2.6e-7 apart, and from step 18 sampled
different answers. The thresholds were measured at one thread and leave room for another CPU's
rounding (tests/examples/test_rlhf.py says how much)."""

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
