"""Engine/trainer log-prob mismatch: the metrics and the truncated importance weights, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos.mismatch import rollout_mismatch, truncated_is_weights

# ℓ_old − ℓ_rollout = [.5, −1, 4.5]; the third token is masked out (its large gap must not count)
TRAINER = torch.tensor([[-1.0, -2.0, -0.5]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -5.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_truncated_is_weights_are_the_ratio_capped_at_c():
    weights = truncated_is_weights(TRAINER, ROLLOUT, cap=1.5)
    assert weights[0, :2].tolist() == pytest.approx([1.5, math.exp(-1.0)])  # e^0.5 = 1.65 is capped
    assert weights[0, 2].item() == pytest.approx(1.5)
    assert not weights.requires_grad


def test_truncated_is_weights_carry_no_gradient():
    trainer = TRAINER.clone().requires_grad_(True)
    assert not truncated_is_weights(trainer, ROLLOUT, cap=2.0).requires_grad


def test_a_cap_must_be_positive():
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(TRAINER, ROLLOUT, cap=0.0)


def test_mismatch_metrics_by_hand():
    metrics = rollout_mismatch(TRAINER, ROLLOUT, MASK, tis_cap=1.5)
    # k3 with d = ℓ_rollout − ℓ_old = [−.5, 1]: e^{.5} − 1 − .5 and e^{−1} − 1 + 1
    k3 = [math.exp(0.5) - 1.5, math.exp(-1.0)]
    assert metrics["rollout/mismatch_kl"] == pytest.approx(sum(k3) / 2)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(0.75)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(1.0)
    assert metrics["rollout/tis_weight_mean"] == pytest.approx((1.5 + math.exp(-1.0)) / 2)
    assert metrics["rollout/tis_capped_fraction"] == pytest.approx(0.5)


def test_equal_streams_show_no_mismatch():
    metrics = rollout_mismatch(TRAINER, TRAINER.clone(), MASK)
    assert metrics["rollout/mismatch_kl"] == 0.0 and metrics["rollout/logprob_diff_max"] == 0.0
    assert "rollout/tis_weight_mean" not in metrics
