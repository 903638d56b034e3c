"""DAPO data-side helpers, AReaL staleness, and classic REINFORCE pieces (docs/algorithms.md §2.7, §7, §8)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import (
    RunningMeanBaseline,
    dapo_group_filter,
    group_stats,
    overlong_reward_penalty,
    reinforce_returns,
    staleness_capacity,
)
from tests.algos.golden_cases import t


def test_group_filter_drops_constant_groups_and_keeps_singletons():
    metric = t([1, 1, 0, 1, 2, 2, 5, 0.3, 0.3 + 1e-12])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4])
    keep = dapo_group_filter(metric, groups)
    assert keep.tolist() == [False, False, True, True, False, False, True, True, True]


def test_group_ids_need_not_be_contiguous_or_equal_sized():
    stats = group_stats(t([1.0, 5.0, 3.0, 7.0, 2.0]), torch.tensor([9, 4, 9, 4, 9]))
    torch.testing.assert_close(stats.mean, t([2.0, 6.0, 2.0, 6.0, 2.0]))
    torch.testing.assert_close(stats.std, t([1.0, math.sqrt(2), 1.0, math.sqrt(2), 1.0]))
    torch.testing.assert_close(stats.size, t([3.0, 2.0, 3.0, 2.0, 3.0]))


def test_overlong_penalty():
    # L_max = 10, L_cache = 4 → L_exp = 6; linear from 0 at 6 to −1 at 10
    penalty = overlong_reward_penalty(torch.tensor([5, 6, 8, 10, 11]), max_length=10, cache_length=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    doubled = overlong_reward_penalty(t([9.0]), max_length=10, cache_length=4, factor=2.0)
    torch.testing.assert_close(doubled, t([-1.5]))
    with pytest.raises(ValueError):
        overlong_reward_penalty(t([1.0]), max_length=4, cache_length=8)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # (η + i + 1)·B − (accepted + running) = 3·4 − 12 = 0
        ({"max_concurrent": 8, "running": 2, "accepted": 10, "version": 1, "max_staleness": 1}, 0),
        # 12 − 6 = 6 = max_concurrent − running
        ({"max_concurrent": 8, "running": 2, "accepted": 4, "version": 1, "max_staleness": 1}, 6),
        ({"max_concurrent": 4, "running": 2, "accepted": 4, "version": 1, "max_staleness": 1}, 2),
        # η = 0 at version 0: only one batch may be in flight
        ({"max_concurrent": 100, "running": 0, "accepted": 0, "version": 0, "max_staleness": 0}, 4),
        ({"max_concurrent": 100, "running": 9, "accepted": 0, "version": 0, "max_staleness": 0}, 0),
    ],
)
def test_staleness_capacity(kwargs, expected):
    assert staleness_capacity(batch_size=4, **kwargs) == expected


def test_reinforce_returns_cartpole_recipe():
    # γ = .5: G = [1 + .5·(1 + .5·1), 1 + .5·1, 1] = [1.75, 1.5, 1]
    raw = reinforce_returns(t([1.0, 1.0, 1.0]), gamma=0.5, standardize=False)
    torch.testing.assert_close(raw, t([1.75, 1.5, 1.0]))
    mean, std = 4.25 / 3, math.sqrt(((1.75 - 4.25 / 3) ** 2 + (1.5 - 4.25 / 3) ** 2 + (1 - 4.25 / 3) ** 2) / 2)
    expected = [(g - mean) / (std + 1.1920929e-07) for g in (1.75, 1.5, 1.0)]
    torch.testing.assert_close(reinforce_returns(t([1.0, 1.0, 1.0]), gamma=0.5), t(expected))


def test_running_mean_baseline_uses_the_past_only():
    baseline = RunningMeanBaseline(decay=0.5)
    assert baseline.value == 0.0
    assert baseline.update(t([2.0, 4.0])) == 3.0  # first batch sets it
    assert baseline.update(t([5.0])) == 4.0  # .5·3 + .5·5
    restored = RunningMeanBaseline()
    restored.load_state_dict(baseline.state_dict())
    assert restored == baseline
