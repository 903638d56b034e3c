"""A multi-turn episode's next turn reuses the keys and values its last turn computed
(rollout/turn_cache.py): it encodes only what the new prompts add, and samples what a full
prefill of them samples."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.engine import LocalEngine, build_engine, left_pad
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.static_decode import StaticDecoding
from posttrain.rollout.turn_cache import KeptRows
from posttrain.rollout.types import SamplingParams
from tests.rollout.conftest import tiny_model

STOPS = tuple(range(4, 24))  # a quarter of the vocabulary: most rows stop early, so finished rows leave the batch


def first_turn_prompts(vocab: int) -> list[list[int]]:
    """Three prompts of 70-90 tokens (enough to pass MIN_REUSED), alike in nothing."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(24, vocab, (length,), generator=generator).tolist() for length in (70, 84, 90)]


def next_turn_prompts(first: list[list[int]], rollouts, n: int) -> list[list[int]]:
    """Each sample's conversation so far, then what an environment answered (a few tokens)."""
    prompts = []
    for row in range(len(rollouts)):
        reply = rollouts.response_ids[row, : int(rollouts.response_lengths[row])].tolist()
        prompts.append([*first[row // n], *reply, 30 + row, 31, 32])
    return prompts


def engine_of(model, tokenizer, kind: str) -> LocalEngine:
    """The native engine decoding step by step, or with fixed shapes (CUDA graphs on a GPU; eager here)."""
    if kind == "step_by_step":
        return build_engine(model, tokenizer, "native")
    decoder = NativeDecoder(model)
    return LocalEngine(model, tokenizer, decoder, static=StaticDecoding(decoder, graphs=False))


@pytest.mark.parametrize("kind", ["step_by_step", "fixed_shapes"])
def test_a_next_turn_encodes_only_what_it_adds_and_samples_what_a_full_prefill_samples(tokenizer, kind):
    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    engine = engine_of(model, tokenizer, kind)
    first, n = first_turn_prompts(len(tokenizer)), 2
    turn = engine.generate(first, SamplingParams(n=n, max_new_tokens=10, seed=0, stop_token_ids=STOPS, keep_cache=True))
    assert 0 < int(turn.response_lengths.min()) < int(turn.response_lengths.max())  # rows left the batch early
    second = next_turn_prompts(first, turn, n)
    sampling = SamplingParams(max_new_tokens=6, seed=1)
    reused = engine.generate(second, sampling)
    encoded = engine.decoder.prefilled_tokens
    engine.drop_kept()
    full = engine.generate(second, sampling)
    assert engine.decoder.prefilled_tokens == sum(map(len, second))
    # each row encodes at most what it adds to its kept row (the environment's answer, the
    # reply's stop token) — the prompts' hundreds of tokens are not encoded again
    assert encoded <= sum(4 + 1 for _ in second) and encoded >= len(second)
    assert torch.equal(reused.response_ids, full.response_ids)
    torch.testing.assert_close(reused.logprobs, full.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["step_by_step", "fixed_shapes"])
def test_kept_rows_serve_only_the_weights_that_computed_them(tokenizer, kind):
    model = tiny_model(tokenizer, "llama")
    engine = engine_of(model, tokenizer, kind)
    first = first_turn_prompts(len(tokenizer))
    turn = engine.generate(first, SamplingParams(max_new_tokens=5, seed=0, keep_cache=True))
    second = next_turn_prompts(first, turn, 1)
    with torch.no_grad():  # an optimizer step between the turns
        next(model.parameters()).mul_(1.01)
    engine.generate(second, SamplingParams(max_new_tokens=3, seed=1))
    assert engine.decoder.prefilled_tokens == sum(map(len, second))  # all encoded again, under the new weights


def test_without_keep_cache_nothing_is_kept(tokenizer):
    model = tiny_model(tokenizer, "llama")
    engine = build_engine(model, tokenizer, "native")
    first = first_turn_prompts(len(tokenizer))
    turn = engine.generate(first, SamplingParams(max_new_tokens=5, seed=0))
    assert engine.kept is None
    second = next_turn_prompts(first, turn, 1)
    engine.generate(second, SamplingParams(max_new_tokens=3, seed=1))
    assert engine.decoder.prefilled_tokens == sum(map(len, second))


def test_columns_a_reused_row_leaves_unwritten_are_never_read_as_nan(tokenizer):
    """Rows reuse different lengths, so a row's columns between its kept prefix and the rest are
    masked padding no layer writes: memory that held NaN must not leak into the logits."""
    model = tiny_model(tokenizer, "llama", kv_heads=2)
    decoder = NativeDecoder(model)
    first = first_turn_prompts(len(tokenizer))
    ids, mask = left_pad(first, tokenizer.pad_token_id)
    decoder.prefill(ids, mask, max_new_tokens=4)
    fed = torch.tensor([[40, 41, 42], [43, 44, 45], [46, 47, 48]])
    for t in range(3):
        decoder.decode(fed[:, t])
    kept = KeptRows(weights=None)
    for row, (keys, values) in enumerate(decoder.kept_rows(torch.arange(3))):
        kept.add(row, 3, keys, values)
    kept.name_tokens(ids, mask, 1, fed)
    # the rows continue after 1, 2 and 3 of their decoded tokens: three reused lengths
    second = [[*first[row], *fed[row, : row + 1].tolist(), 60, 61] for row in range(3)]
    ids, mask = left_pad(second, tokenizer.pad_token_id)
    reuse = kept.reuse_for(ids, mask)
    assert reuse is not None and len(set(reuse.lengths.tolist())) == 3
    shape = (len(decoder.layers), 3, decoder.kv_heads, 2 * ids.shape[1] + 4, decoder.head_dim)
    poisoned = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
    reused = decoder.prefill(ids, mask, max_new_tokens=4, cache=poisoned, reuse=reuse).clone()
    full = decoder.prefill(ids, mask, max_new_tokens=4)
    torch.testing.assert_close(reused, full, atol=1e-5, rtol=0)


def test_a_turn_that_switches_weights_mid_way_keeps_nothing(tokenizer):
    """rollout.interrupt: weights taken mid-generation make every kept key and value stale."""
    from tests.rollout.test_interrupt import ScheduledMailbox, new_weights

    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    mailbox = ScheduledMailbox(visible_at=3)
    engine = build_engine(model, tokenizer, "native", policy_version=5, mailbox=mailbox)
    engine.offer_weights(6, new_weights(tokenizer))
    first = first_turn_prompts(len(tokenizer))
    turn = engine.generate(first, SamplingParams(max_new_tokens=8, seed=0, keep_cache=True))
    assert engine.policy_version == 6 and engine.kept is None
    second = next_turn_prompts(first, turn, 1)
    engine.generate(second, SamplingParams(max_new_tokens=3, seed=1))
    assert engine.decoder.prefilled_tokens == sum(map(len, second))
