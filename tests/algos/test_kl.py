"""KL estimators, reward shaping and controllers (docs/algorithms.md §3)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import (
    AdaptiveKLControllerHorizon,
    AdaptiveKLControllerPPO,
    FixedKLController,
    kl_estimate,
    place_scores_at_last_token,
    shape_token_rewards,
)
from tests.algos.golden_cases import t

# d = ℓ − ℓ_ref = [.5, −1]
LOGP, REF = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [0.5, -1.0]),
        ("kl", [0.5, -1.0]),  # verl's name
        ("k2", [0.125, 0.5]),
        ("mse", [0.125, 0.5]),
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),  # e^{−d} − 1 + d
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("abs", [0.5, 1.0]),
        ("k1+", [0.5, -1.0]),
        ("k3+", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_kl_values(kind, expected):
    torch.testing.assert_close(kl_estimate(LOGP, REF, kind), t([expected]))


@pytest.mark.parametrize("kind", ["k1+", "k3+"])
def test_straight_through_variants_take_the_k2_gradient(kind):
    logp = LOGP.clone().requires_grad_(True)
    kl_estimate(logp, REF, kind).sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.5, -1.0]]))  # ∂(d²/2)/∂ℓ = d


def test_k3_clamps_and_masks():
    huge = kl_estimate(t([[-50.0]]), t([[0.0]]), "k3")  # e^{50} would be 5e21
    assert huge.item() == 10.0
    unclamped = kl_estimate(t([[-5.0]]), t([[0.0]]), "k3", clamp_value=None)
    torch.testing.assert_close(unclamped, t([[math.exp(5) - 1 - 5]]))
    masked = kl_estimate(LOGP, REF, "k1", response_mask=t([[1, 0]]))
    torch.testing.assert_close(masked, t([[0.5, 0.0]]))


def test_unknown_estimator_lists_choices():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(LOGP, REF, "k4")


def test_scores_go_on_the_last_valid_token():
    mask = t([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    rewards = place_scores_at_last_token(t([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(rewards, t([[0, 2, 0, 0], [0, 0, 3, 0], [0, 0, 0, 0]]))


def test_kl_in_reward_token_and_sequence_level():
    old, ref, mask = t([[-1.0, -1.0, -9.0]]), t([[-1.5, -0.8, 0.0]]), t([[1, 1, 0]])
    # k1 = [.5, −.2]; token level: [−β·.5, 1 − β·(−.2)]
    rewards, metrics = shape_token_rewards(t([1.0]), old, ref, mask, beta=0.1)
    torch.testing.assert_close(rewards, t([[-0.05, 1.02, 0.0]]))
    torch.testing.assert_close(metrics["kl"], t(0.15))  # token mean of [.5, −.2]
    rewards, _ = shape_token_rewards(t([1.0]), old, ref, mask, beta=0.1, level="sequence")
    torch.testing.assert_close(rewards, t([[0.0, 1.0 - 0.1 * 0.3, 0.0]]))


def test_controllers():
    assert FixedKLController(0.05).update(123.0, 64) == 0.05
    ppo = AdaptiveKLControllerPPO(value=1.0, target=0.1)
    assert ppo.update(0.05) == 0.5  # 0.05 < 0.1/1.5
    assert ppo.update(0.1) == 0.5  # inside the band: unchanged
    assert ppo.update(0.2) == 1.0  # 0.2 > 0.15
    horizon = AdaptiveKLControllerHorizon(value=0.1, target=6.0, horizon=10000)
    # e = clip(3/6 − 1, −.2, .2) = −.2; β ← .1·(1 − .2·256/10000)
    assert math.isclose(horizon.update(3.0, 256), 0.099488)
    # e = clip(6.6/6 − 1) = .1; β ← .099488·(1 + .1·100/10000)
    assert math.isclose(horizon.update(6.6, 100), 0.099488 * 1.001)
