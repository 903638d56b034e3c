"""The learning-rate schedules themselves, value by value, and as the offline loop applies them."""

from __future__ import annotations

import math

import pytest

from posttrain.train.schedule import SCHEDULES, lr_multiplier


def values(schedule: str, warmup: int, total: int, steps: int, min_ratio: float = 0.0) -> list[float]:
    factor = lr_multiplier(schedule, warmup, total, min_ratio)
    return [factor(step) for step in range(steps)]


def test_warmup_is_linear_from_one_over_warmup_and_then_constant():
    # step 0 already trains (1/4 of the rate, not 0), the full rate is reached at step 3
    assert values("constant_with_warmup", 4, 10, 7) == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1, 1])


def test_no_warmup_starts_at_the_full_rate():
    for schedule in SCHEDULES:
        assert lr_multiplier(schedule, 0, 10)(0) == 1.0


def test_cosine_falls_half_a_cosine_to_min_ratio_at_the_last_step_and_stays():
    warmup, total, floor = 2, 10, 0.1
    got = values("cosine", warmup, total, 14, floor)
    assert got[:2] == pytest.approx([0.5, 1.0])
    for step in range(warmup, 14):
        progress = min(1.0, (step - warmup) / (total - warmup))
        assert got[step] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    assert got[6] == pytest.approx(0.55)  # half way: the mean of 1 and the floor
    assert got[10:] == pytest.approx([floor] * 4)  # past total_steps, no second cosine


def test_linear_falls_straight_to_min_ratio():
    assert values("linear", 0, 4, 6) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert values("linear", 1, 5, 6, min_ratio=0.2) == pytest.approx([1.0, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_warmup_longer_than_the_run_never_exceeds_the_base_rate():
    assert values("cosine", 8, 4, 4) == pytest.approx([0.125, 0.25, 0.375, 0.5])


def test_an_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"'exponential'.*constant_with_warmup, cosine, linear"):
        lr_multiplier("exponential", 0, 10)
