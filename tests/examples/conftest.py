"""Every example's runs, checked after its test: the reward-hacking alarm (train/hacking_alarm.py)
fires only where a test module expects it (``ALARMS_EXPECTED``: the run folders that raise it,
e.g. the RLHF example's β = 0 run); every other run of every example stays silent."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def the_alarm_fires_only_where_expected(request, tmp_path):
    yield
    fired = sorted(path.parent.name for path in tmp_path.rglob("alarm.json"))
    assert fired == sorted(getattr(request.module, "ALARMS_EXPECTED", [])), fired
