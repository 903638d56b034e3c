"""Sampling filters against hand-worked examples."""

from __future__ import annotations

import math

import torch

from posttrain.rollout.sampling import choose_tokens, gumbel_max_sample, min_p_filter, top_k_filter, top_p_filter

NEG = float("-inf")


def logits_of(probs):
    return torch.log(torch.tensor([probs]))


def test_top_k_keeps_the_k_largest():
    out = top_k_filter(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), 2)
    assert out.tolist() == [[NEG, 3.0, 2.0, NEG]]
    assert torch.equal(top_k_filter(torch.tensor([[1.0, 2.0]]), 0), torch.tensor([[1.0, 2.0]]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities .5, .3, .15, .05: p = .7 needs the first two; p = .8 exactly reaches with two
    out = top_p_filter(logits_of([0.15, 0.5, 0.05, 0.3]), 0.7)
    assert torch.isinf(out).tolist() == [[True, False, True, False]]
    out = top_p_filter(logits_of([0.15, 0.5, 0.05, 0.3]), 0.81)
    assert torch.isinf(out).tolist() == [[False, False, True, False]]
    tiny = top_p_filter(logits_of([0.15, 0.5, 0.05, 0.3]), 0.01)  # the top token always survives
    assert torch.isinf(tiny).tolist() == [[True, False, True, True]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # top .5; min_p .25 → threshold .125: .15 stays, .05 goes
    out = min_p_filter(logits_of([0.15, 0.5, 0.05, 0.3]), 0.25)
    assert torch.isinf(out).tolist() == [[False, False, True, False]]


def test_greedy_bans_pad_and_reports_temperature_one_logprob():
    logits = logits_of([0.6, 0.3, 0.1])
    tokens, logprobs = choose_tokens(logits, temperature=0.5, greedy=True, banned_token=0)
    assert tokens.tolist() == [1]
    assert math.isclose(logprobs.item(), math.log(0.3), rel_tol=1e-6)


def test_sampled_logprob_is_under_the_tempered_untruncated_distribution():
    logits = logits_of([0.6, 0.3, 0.1])
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = choose_tokens(logits, temperature=2.0, top_k=1, generator=generator)
    assert tokens.tolist() == [0]  # top-k 1 leaves only the most likely token
    tempered = torch.log_softmax(logits / 2.0, dim=-1)[0, 0]
    assert math.isclose(logprobs.item(), tempered.item(), rel_tol=1e-6)


def test_gumbel_max_draws_follow_the_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = logits_of([0.6, 0.3, 0.1]).expand(20000, 3)
    counts = torch.bincount(gumbel_max_sample(logits, generator), minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)
