"""Sampling rules against hand-worked examples."""

from __future__ import annotations

import math

import torch

from posttrain.rollout.sampling import (
    CDF_BLOCK,
    SamplingWorkspace,
    behaviour_logprobs,
    choose_tokens,
    kept_ids,
    min_p_filter,
    sample_categorical,
    sample_from_weights,
    top_k_filter,
    top_p_filter,
)
from posttrain.rollout.types import SamplingParams

NEG = float("-inf")
PROBS = [0.15, 0.5, 0.05, 0.3]


def logits_of(probs):
    return torch.log(torch.tensor([probs]))


def test_top_k_keeps_the_k_largest():
    out = top_k_filter(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), 2)
    assert out.tolist() == [[NEG, 3.0, 2.0, NEG]]
    assert top_k_filter(torch.tensor([[1.0, 2.0]]), 0).tolist() == [[1.0, 2.0]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted: .5, .3, .15, .05. p = .7 needs the first two; .81 needs three; .01 keeps the top one
    assert torch.isinf(top_p_filter(logits_of(PROBS), 0.7)).tolist() == [[True, False, True, False]]
    assert torch.isinf(top_p_filter(logits_of(PROBS), 0.81)).tolist() == [[False, False, True, False]]
    assert torch.isinf(top_p_filter(logits_of(PROBS), 0.01)).tolist() == [[True, False, True, True]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # top .5; min_p .25 → threshold .125: .15 stays, .05 goes; min_p .7 → .35: only .5 stays
    assert torch.isinf(min_p_filter(logits_of(PROBS), 0.25)).tolist() == [[False, False, True, False]]
    assert torch.isinf(min_p_filter(logits_of(PROBS), 0.7)).tolist() == [[True, False, True, True]]


def test_categorical_draws_follow_the_softmax_and_skip_impossible_tokens(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([0.6, 0.0, 0.3, 0.1, 0.0])).expand(20000, 5)
    draws = sample_categorical(logits, generator)
    frequencies = torch.bincount(draws, minlength=5).float() / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.6, 0.0, 0.3, 0.1, 0.0]), atol=0.015, rtol=0)
    # even a uniform number of exactly 1 (rounding can get there) lands on a possible token
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones_like(rand(*args, **kwargs)))
    assert sample_categorical(torch.tensor([[0.0, NEG, 1.0, NEG]]), generator).tolist() == [2]


def test_greedy_bans_pad_and_reports_temperature_one_logprob():
    tokens, logprobs, _ = choose_tokens(logits_of([0.6, 0.3, 0.1]), temperature=0.5, greedy=True, banned_token=0)
    assert tokens.tolist() == [1]
    assert math.isclose(logprobs.item(), math.log(0.3), rel_tol=1e-6)


def test_sampling_never_picks_the_banned_token():
    logits = logits_of([0.98, 0.01, 0.01]).expand(2000, 3)
    tokens, logprobs, _ = choose_tokens(
        logits, temperature=1.0, banned_token=0, generator=torch.Generator().manual_seed(0)
    )
    assert not tokens.eq(0).any() and tokens.eq(1).any() and tokens.eq(2).any()
    # the ban is a guard, not a sampling rule: the log-prob is under the full distribution
    torch.testing.assert_close(logprobs, torch.full((2000,), math.log(0.01)))


def test_logprob_is_that_of_the_truncated_renormalised_distribution():
    logits = logits_of(PROBS)  # .15 .5 .05 .3
    tokens, logprobs, mask = choose_tokens(
        logits.expand(4000, 4), temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0), with_mask=True
    )
    # top-p .7 keeps .5 and .3 (which reach .8); renormalised: .625 and .375
    assert set(tokens.tolist()) == {1, 3}
    expected = torch.where(tokens == 1, math.log(0.5 / 0.8), math.log(0.3 / 0.8))
    torch.testing.assert_close(logprobs, expected.float())
    assert mask.tolist() == [[1, 3]] * 4000  # each row's kept ids, ascending
    # the draws follow the renormalised distribution
    assert abs(float(tokens.eq(1).float().mean()) - 0.625) < 0.03
    # tempered first, then truncated: temperature 2 flattens to ∝ √p, top-k 1 keeps the top alone
    tokens, logprobs, mask = choose_tokens(logits, temperature=2.0, top_k=1, generator=torch.Generator())
    assert tokens.tolist() == [1] and logprobs.tolist() == [0.0] and mask is None  # not asked for


def test_kept_ids_pad_rows_of_different_sizes():
    filtered = torch.tensor([[0.0, NEG, 1.0, 2.0], [NEG, NEG, 3.0, NEG]])
    assert kept_ids(filtered).tolist() == [[0, 2, 3], [2, -1, -1]]


def test_behaviour_logprobs_repeat_what_the_sampler_reported():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    rules = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05}
    tokens, logprobs, _ = choose_tokens(logits, generator=torch.Generator().manual_seed(1), banned_token=7, **rules)
    again = behaviour_logprobs(logits, tokens, SamplingParams(**rules))
    torch.testing.assert_close(again, logprobs, rtol=0, atol=1e-6)
    full = torch.log_softmax(logits / 0.8, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert (logprobs - full).min() > 0  # renormalised over fewer tokens: every one is larger


def test_temperature_sharpens_the_draws():
    logits = logits_of([0.6, 0.3, 0.1]).expand(20000, 3)
    tokens = choose_tokens(logits, temperature=0.5, generator=torch.Generator().manual_seed(1)).tokens
    # softmax(log p / 0.5) ∝ p²: .36, .09, .01 → .783, .196, .022
    frequencies = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.7826, 0.1957, 0.0217]), atol=0.015, rtol=0)


def test_two_level_draws_follow_the_weights_across_blocks(monkeypatch):
    # a vocabulary of two full blocks and a partial one; mass in each block, zeros around it
    vocab = 2 * CDF_BLOCK + 37
    weights = torch.zeros(vocab)
    # block edges, the last token, two tokens in a later block (so the offset into it matters)
    chosen = {3: 0.2, CDF_BLOCK - 1: 0.1, CDF_BLOCK: 0.3, 2 * CDF_BLOCK + 5: 0.15, 2 * CDF_BLOCK + 36: 0.25}
    for token, weight in chosen.items():
        weights[token] = weight * 5.0  # unnormalised
    draws = sample_from_weights(weights.expand(40000, vocab), torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=vocab).float() / 40000
    assert set(torch.nonzero(frequencies).flatten().tolist()) == set(chosen)
    for token, weight in chosen.items():
        assert abs(frequencies[token].item() - weight) < 0.01, (token, frequencies[token].item())
    # u at the very top of the range still lands on a token of positive weight
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones_like(rand(*args, **kwargs)))
    assert sample_from_weights(weights[None], torch.Generator()).tolist() == [2 * CDF_BLOCK + 36]
    weights[2 * CDF_BLOCK :] = 0.0  # the last block empty: the top is block 1's last token
    assert sample_from_weights(weights[None], torch.Generator()).tolist() == [CDF_BLOCK]


def test_a_small_token_in_a_large_vocabulary_keeps_its_probability():
    # one token of weight 1e-3 after a dominant one and 10k tokens of weight 1e-9 (which a
    # float32 cumsum would round away on top of 1.0)
    vocab = 10_000
    weights = torch.full((vocab,), 1e-9)
    weights[10], weights[8_000] = 1.0, 1e-3
    draws = sample_from_weights(weights.expand(20_000, vocab), torch.Generator().manual_seed(0))
    expected = 20_000 * 1e-3 / (1.0 + 1e-3 + 1e-9 * (vocab - 2))
    assert abs(int(draws.eq(8_000).sum()) - expected) < 5 * expected**0.5  # ~20 ± 4.5


def test_a_workspace_reuses_its_buffers_and_gives_the_same_choice():
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0))
    workspace = SamplingWorkspace()
    plain = choose_tokens(logits, temperature=0.7, banned_token=5, generator=torch.Generator().manual_seed(1))
    first = choose_tokens(
        logits, temperature=0.7, banned_token=5, generator=torch.Generator().manual_seed(1), workspace=workspace
    )
    buffers = {name: buffer.data_ptr() for name, buffer in workspace._buffers.items()}
    again = choose_tokens(
        logits[:4], temperature=0.7, banned_token=5, generator=torch.Generator().manual_seed(1), workspace=workspace
    )
    assert {name: buffer.data_ptr() for name, buffer in workspace._buffers.items()} == buffers
    for a, b in zip(plain[:2], first[:2], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(again[0], first[0][:4])
    assert torch.equal(logits, torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)))  # not written
