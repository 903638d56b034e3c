"""Estimators that read more than one number per sample (GDPO's components, ReMax's greedy
baseline) never read a missing score (NaN) as 0."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import ADVANTAGE_ESTIMATORS

MASK = torch.ones(4, 2)
GROUPS = torch.tensor([0, 0, 1, 1])


def test_gdpo_leaves_out_a_component_that_applies_to_none_of_a_groups_samples():
    # component 2 applies to group 0 only (None for both samples of group 1, TRL's multi-task)
    components = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, math.nan], [0.0, math.nan]])
    adv, _ = ADVANTAGE_ESTIMATORS["gdpo"](MASK, MASK, GROUPS, components, batch_norm="sequence")
    # per group (c − μ)/(σ + 1e-6), σ unbiased: ±0.7071; S = [0, 0, 0.7071, −0.7071]
    s = torch.tensor([0.0, 0.0, 1.0, -1.0]) / math.sqrt(2)
    expected = (s - s.mean()) / (s.std() + 1e-4)
    assert torch.allclose(adv[:, 0], expected, atol=1e-5) and torch.isfinite(adv).all()


def test_gdpo_refuses_a_component_missing_for_part_of_a_group():
    components = torch.tensor([[1.0, 0.0], [0.0, math.nan], [1.0, 2.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"component 1 is missing \(NaN\) for sample 1 .*masked out"):
        ADVANTAGE_ESTIMATORS["gdpo"](MASK, MASK, GROUPS, components)


def test_remax_refuses_a_missing_greedy_baseline_instead_of_subtracting_0():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"baseline_scores.*sample 1"):
        ADVANTAGE_ESTIMATORS["remax"](rewards, torch.ones(2, 2), baseline_scores=torch.tensor([0.5, math.nan]))
