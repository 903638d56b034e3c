"""Value, preference, SFT, entropy and combined actor losses (docs/algorithms.md §4.9–§6)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import (
    actor_loss,
    bradley_terry_loss,
    dpo_loss,
    entropy_from_logits,
    sft_loss,
    value_loss,
)
from tests.algos.golden_cases import t


def nls(x: float) -> float:
    return math.log1p(math.exp(-x))


def test_clipped_value_loss():
    # v_clip = .5 + clip(1 − .5, ±.2) = .7; errors: max((1−2)², (.7−2)²) = 1.69 and max(1, 1) = 1
    values, old, returns, mask = t([[1.0, 2.0]]), t([[0.5, 2.0]]), t([[2.0, 1.0]]), t([[1, 1]])
    loss, metrics = value_loss(values, old, returns, mask, clip_range=0.2)
    torch.testing.assert_close(loss, t(0.5 * (1.69 + 1.0) / 2))
    torch.testing.assert_close(metrics["clip_fraction"], t(0.5))
    unclipped, _ = value_loss(values, old, returns, mask, clip_range=None)
    torch.testing.assert_close(unclipped, t(0.5 * (1.0 + 1.0) / 2))


def test_bradley_terry():
    chosen, rejected = t([1.0, 0.0]), t([0.0, 0.5])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    torch.testing.assert_close(loss, t((nls(1.0) + nls(-0.5)) / 2))
    torch.testing.assert_close(metrics["accuracy"], t(0.5))
    with_margin, _ = bradley_terry_loss(chosen, rejected, margin=t([0.5, 0.0]))
    torch.testing.assert_close(with_margin, t((nls(0.5) + nls(-0.5)) / 2))
    centred, _ = bradley_terry_loss(chosen, rejected, center_coef=0.01)
    torch.testing.assert_close(centred, t((nls(1.0) + nls(-0.5)) / 2 + 0.01 * (1.0 + 0.25) / 2))


def test_dpo_loss_wraps_the_registry_and_reports_implicit_rewards():
    # Δ_w = [1, 0], Δ_l = [−1, 1], β = .5
    args = (t([-1.0, -2.0]), t([-3.0, -1.0]), t([-2.0, -2.0]), t([-2.0, -2.0]))
    loss, metrics = dpo_loss(*args, beta=0.5, loss_type="sigmoid")
    torch.testing.assert_close(loss, t((nls(1.0) + nls(-0.5)) / 2))
    torch.testing.assert_close(metrics["rewards/chosen"], t(0.25))  # β·mean(Δ_w)
    torch.testing.assert_close(metrics["rewards/margin"], t(0.25))  # β·mean(h) = .5·.5
    torch.testing.assert_close(metrics["rewards/accuracy"], t(0.5))
    hinge, _ = dpo_loss(*args, beta=0.5, loss_type="hinge")
    torch.testing.assert_close(hinge, t(0.75))


def test_rpo_adds_the_chosen_responses_nll_per_token():
    # Δ_w = [1, 0], Δ_l = [−1, 1], β = .5; chosen sums π_w = [−1, −2] over n_w = [2, 4] tokens
    args = (t([-1.0, -2.0]), t([-3.0, -1.0]), t([-2.0, -2.0]), t([-2.0, -2.0]))
    lengths = {"chosen_lengths": t([2.0, 4.0]), "rejected_lengths": t([3.0, 3.0])}
    plain, metrics = dpo_loss(*args, beta=0.5, **lengths)
    torch.testing.assert_close(metrics["nll"], t((0.5 + 0.5) / 2))  # mean of −π_w / n_w
    rpo, _ = dpo_loss(*args, beta=0.5, nll_coef=2.0, **lengths)
    torch.testing.assert_close(rpo, plain + 2.0 * 0.5)

    # the term's gradient raises each chosen log-prob by α / (N·n_w) more, rejected ones as before
    def gradients(nll_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
        dpo_loss(chosen, rejected, *args[2:], beta=0.5, nll_coef=nll_coef, **lengths)[0].backward()
        return chosen.grad, rejected.grad

    (chosen_plain, rejected_plain), (chosen_rpo, rejected_rpo) = gradients(0.0), gradients(2.0)
    torch.testing.assert_close(chosen_rpo - chosen_plain, t([-0.5, -0.25]))
    torch.testing.assert_close(rejected_rpo, rejected_plain)
    with pytest.raises(ValueError, match="nll_coef needs chosen_lengths"):
        dpo_loss(*args, nll_coef=1.0)


def test_dpo_rejects_bad_options():
    args = (t([0.0]), t([0.0]), t([0.0]), t([0.0]))
    with pytest.raises(KeyError, match="valid names: hinge, ipo, robust, sigmoid"):
        dpo_loss(*args, loss_type="sigmod")
    with pytest.raises(ValueError, match=r"label_smoothing < 0\.5"):
        dpo_loss(*args, loss_type="robust", label_smoothing=0.5)
    for loss_type in ("ipo", "hinge"):  # no label-noise term: ε must not be silently ignored
        with pytest.raises(ValueError, match=f"{loss_type} has no label_smoothing term"):
            dpo_loss(*args, loss_type=loss_type, label_smoothing=0.1)


def test_sft_loss_only_counts_completion_tokens():
    logprobs = t([[-5.0, -1.0, -3.0], [-9.0, -2.0, -100.0]])
    mask = t([[0, 1, 1], [0, 1, 0]])
    torch.testing.assert_close(sft_loss(logprobs, mask), t((1 + 3 + 2) / 3))
    torch.testing.assert_close(sft_loss(logprobs, mask, "seq-mean-token-mean"), t((2 + 2) / 2))


def test_entropy_from_logits():
    uniform = torch.zeros(2, 4, dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(uniform), t([math.log(4)] * 2))
    # p = [.8, .2]: H = −(.8 ln .8 + .2 ln .2)
    logits = t([[math.log(0.8), math.log(0.2)]])
    torch.testing.assert_close(entropy_from_logits(logits), t([-(0.8 * math.log(0.8) + 0.2 * math.log(0.2))]))
    assert entropy_from_logits(torch.zeros(3, 5, dtype=torch.bfloat16)).dtype == torch.float32


def test_actor_loss_adds_entropy_bonus_and_kl_with_the_same_aggregation():
    mask = t([[1, 1], [1, 0]])
    entropy, kl = t([[1.0, 2.0], [3.0, 50.0]]), t([[0.1, 0.2], [0.3, 9.0]])
    total, metrics = actor_loss(t(1.0), mask, entropy=entropy, entropy_coef=0.01, kl=kl, kl_coef=0.5)
    # token-mean: H = 6/3 = 2, kl = .6/3 = .2 → 1 − .01·2 + .5·.2
    torch.testing.assert_close(total, t(1.0 - 0.02 + 0.1))
    torch.testing.assert_close(metrics["entropy"], t(2.0))
    seq_total, _ = actor_loss(t(1.0), mask, entropy=entropy, entropy_coef=0.01, agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(seq_total, t(1.0 - 0.01 * (1.5 + 3.0) / 2))


def test_explained_variance_parts_add_up_to_the_whole_batch_s():
    """Summed over two halves of a batch, the parts give value_loss's explained variance of the
    whole batch; the mean of the halves' own explained variances does not."""
    from posttrain.algos.value import explained_variance_of, explained_variance_parts, value_loss

    g = torch.Generator().manual_seed(0)
    returns = torch.randn(6, 5, generator=g) * torch.tensor([[1.0], [1.0], [1.0], [9.0], [9.0], [9.0]])
    values = returns + torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.2).float()
    _, whole = value_loss(values, values, returns, mask)
    halves = [explained_variance_parts(values[rows], returns[rows], mask[rows]) for rows in (slice(0, 3), slice(3, 6))]
    summed = {name: halves[0][name] + halves[1][name] for name in halves[0]}
    assert explained_variance_of(summed) == pytest.approx(float(whole["explained_variance"]), abs=1e-5)
    own = [
        float(value_loss(values[r], values[r], returns[r], mask[r])[1]["explained_variance"])
        for r in (slice(0, 3), slice(3, 6))
    ]
    assert abs(sum(own) / 2 - float(whole["explained_variance"])) > 0.05
