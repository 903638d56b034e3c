"""Invariants of the algorithm core, checked on random inputs with hypothesis."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from posttrain.algos import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, POLICY_LOSSES, aggregate_loss

SETTINGS = settings(max_examples=40, deadline=None)
GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "gpg", "gdpo", "reinforce_pp_baseline"]


@st.composite
def masks(draw, min_rows: int = 1, max_rows: int = 6, max_len: int = 7, interior_zeros: bool = True):
    """0/1 masks [B, T]; every row keeps at least one valid token; interior zeros optional."""
    rows = draw(st.integers(min_rows, max_rows))
    length = draw(st.integers(1, max_len))
    mask = []
    for _ in range(rows):
        n_valid = draw(st.integers(1, length))
        if interior_zeros:
            row = draw(st.lists(st.booleans(), min_size=length, max_size=length))
            row[draw(st.integers(0, length - 1))] = True
        else:
            row = [i < n_valid for i in range(length)]
        mask.append(row)
    return torch.tensor(mask, dtype=torch.float64)


def random_like(mask: torch.Tensor, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(mask.shape, generator=generator, dtype=torch.float64) * scale


def estimator_inputs(mask: torch.Tensor, seed: int, group_size: int) -> dict[str, torch.Tensor]:
    """Outcome rewards on each row's last valid token, a critic's values, groups, components."""
    generator = torch.Generator().manual_seed(seed)
    batch = mask.shape[0]
    scores = torch.randint(0, 3, (batch,), generator=generator).to(torch.float64)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(batch), last] = scores
    return {
        "token_rewards": token_rewards,
        "response_mask": mask,
        "group_ids": torch.arange(batch) // group_size,
        "values": random_like(mask, seed + 1),
        "baseline_scores": torch.rand(batch, generator=generator, dtype=torch.float64),
        "reward_components": torch.randint(0, 2, (batch, 3), generator=generator).to(torch.float64),
    }


def compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's valid entries to the front, in order (what right padding would look like)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        valid = x[i][mask[i].bool()]
        out[i, : valid.numel()] = valid
    return out


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@SETTINGS
@given(mask=masks(), seed=st.integers(0, 10_000), group_size=st.integers(1, 4))
def test_estimators_are_zero_off_mask_and_ignore_what_sits_there(name, mask, seed, group_size):
    inputs = estimator_inputs(mask, seed, group_size)
    advantages, returns = ADVANTAGE_ESTIMATORS[name](**inputs)
    off = mask == 0
    assert torch.all(advantages[off] == 0) and torch.all(returns[off] == 0)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    junk = dict(inputs)
    junk["token_rewards"] = torch.where(off, torch.full_like(mask, float("nan")), inputs["token_rewards"])
    junk["values"] = torch.where(off, random_like(mask, seed + 2, scale=1e3), inputs["values"])
    again, again_returns = ADVANTAGE_ESTIMATORS[name](**junk)
    torch.testing.assert_close(again, advantages)
    torch.testing.assert_close(again_returns, returns)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@SETTINGS
@given(mask=masks(), seed=st.integers(0, 10_000), group_size=st.integers(1, 4))
def test_interior_mask_zeros_behave_like_tokens_that_are_not_there(name, mask, seed, group_size):
    """Multi-turn masks: observation tokens inside a response are skipped, not treated as breaks."""
    inputs = estimator_inputs(mask, seed, group_size)
    advantages, returns = ADVANTAGE_ESTIMATORS[name](**inputs)
    packed = dict(inputs)
    for key in ("token_rewards", "values"):
        packed[key] = compact(inputs[key], mask)
    packed["response_mask"] = compact(mask, mask)
    packed_adv, packed_returns = ADVANTAGE_ESTIMATORS[name](**packed)
    torch.testing.assert_close(compact(advantages, mask), packed_adv)
    torch.testing.assert_close(compact(returns, mask), packed_returns)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@SETTINGS
@given(mask=masks(min_rows=2), seed=st.integers(0, 10_000), value=st.floats(-5, 5))
def test_identical_rewards_in_every_group_give_zero_advantage(name, mask, seed, value):
    inputs = estimator_inputs(mask, seed, group_size=2)
    inputs["token_rewards"] = torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    inputs["token_rewards"][torch.arange(mask.shape[0]), last] = value
    inputs["reward_components"] = torch.full_like(inputs["reward_components"], value)
    # singletons keep their raw reward by convention (docs/algorithms.md §10.2): use groups of >= 2
    if mask.shape[0] % 2:
        inputs["group_ids"][-1] = inputs["group_ids"][-2]
    advantages, _ = ADVANTAGE_ESTIMATORS[name](**inputs)
    assert torch.isfinite(advantages).all()
    assert torch.all(advantages == 0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gpg"])
@SETTINGS
@given(mask=masks(min_rows=4), seed=st.integers(0, 10_000), value=st.floats(-5, 5))
def test_a_constant_group_gets_zero_even_beside_varying_groups(name, mask, seed, value):
    inputs = estimator_inputs(mask, seed, group_size=2)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    inputs["token_rewards"][0, last[0]] = value
    inputs["token_rewards"][1, last[1]] = value
    inputs["group_ids"] = torch.tensor([0, 0] + [1 + i // 2 for i in range(mask.shape[0] - 2)])
    if mask.shape[0] % 2:
        inputs["group_ids"][-1] = inputs["group_ids"][-2]
    advantages, _ = ADVANTAGE_ESTIMATORS[name](**inputs)
    assert torch.isfinite(advantages).all()
    assert torch.all(advantages[:2] == 0)


def _loss_inputs(mask: torch.Tensor, seed: int, per_sequence_advantage: bool) -> dict[str, torch.Tensor]:
    logprobs = -random_like(mask, seed).abs()
    old = logprobs.detach() + 0.3 * random_like(mask, seed + 1)
    advantages = random_like(mask, seed + 2)
    if per_sequence_advantage:
        advantages = advantages[:, :1].expand_as(mask).clone()
    return {
        "logprobs": logprobs.requires_grad_(True),
        "old_logprobs": old,
        "advantages": advantages * mask,
        "response_mask": mask,
    }


@pytest.mark.parametrize("agg_mode", AGGREGATION_MODES)
@SETTINGS
@given(mask=masks(), seed=st.integers(0, 10_000))
def test_ppo_clip_gradient_equals_policy_gradient_at_ratio_one(agg_mode, mask, seed):
    inputs = _loss_inputs(mask, seed, per_sequence_advantage=False)
    inputs["old_logprobs"] = inputs["logprobs"].detach().clone()
    grads = []
    for name in ("ppo_clip", "pg"):
        logprobs = inputs["logprobs"].detach().clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES[name](**{**inputs, "logprobs": logprobs}, agg_mode=agg_mode)
        loss.backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("agg_mode", AGGREGATION_MODES)
@SETTINGS
@given(mask=masks(), seed=st.integers(0, 10_000), clip=st.sampled_from([3e-4, 0.05, 0.2]))
def test_gspo_equals_gspo_token_for_sequence_constant_advantages(agg_mode, mask, seed, clip):
    inputs = _loss_inputs(mask, seed, per_sequence_advantage=True)
    results = []
    for name in ("gspo", "gspo_token"):
        logprobs = inputs["logprobs"].detach().clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES[name](
            **{**inputs, "logprobs": logprobs}, agg_mode=agg_mode, clip_low=clip, clip_high=clip
        )
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@SETTINGS
@given(mask=masks(), seed=st.integers(0, 10_000))
def test_losses_ignore_masked_tokens_and_interior_gaps(name, mask, seed):
    inputs = _loss_inputs(mask, seed, per_sequence_advantage=False)
    inputs["proximal_logprobs"] = inputs["old_logprobs"] + 0.1 * random_like(mask, seed + 3)
    loss, metrics = POLICY_LOSSES[name](**inputs)
    assert torch.isfinite(loss) and {"clip_fraction", "approx_kl"} <= metrics.keys()
    loss.backward()
    assert torch.all(inputs["logprobs"].grad[mask == 0] == 0)
    packed = {key: compact(value.detach(), mask) for key, value in inputs.items()}
    packed["response_mask"] = compact(mask, mask)
    packed_loss, _ = POLICY_LOSSES[name](**packed)
    torch.testing.assert_close(packed_loss, loss.detach())


@pytest.mark.parametrize("agg_mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"])
@SETTINGS
@given(mask=masks(min_rows=2, max_rows=8), seed=st.integers(0, 10_000), micro=st.integers(1, 4))
def test_gradient_accumulation_with_global_counts_equals_the_full_batch(agg_mode, mask, seed, micro):
    """TRL's invariance: batch B × accumulation 1 equals micro-batches summed with global counts."""
    per_token = random_like(mask, seed)
    full = aggregate_loss(per_token, mask, agg_mode)
    counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum()}
    pieces = sum(
        aggregate_loss(per_token[i : i + micro], mask[i : i + micro], agg_mode, **counts)
        for i in range(0, mask.shape[0], micro)
    )
    torch.testing.assert_close(pieces, full)
