"""Fixed-shape decoding (static_decode.py) samples what the step-by-step loop samples.

Here on the CPU its step runs eagerly; the same step replayed as a CUDA graph is checked on a
GPU by benchmarks/gpu_step.py (graph vs eager tokens, log-probs, new weights after a sync).
"""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.engine import LocalEngine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.static_decode import StaticDecoding, bucket_for
from posttrain.rollout.types import SamplingParams
from tests.rollout.conftest import NAMES, encode, full_forward_logprobs, tiny_model
from tests.rollout.test_engine import COMMON, check_bookkeeping

PROMPTS = (*NAMES, "ab", "a much longer name than the others")  # 5 prompts of ragged lengths


def engines(model, tokenizer, dtype=None):
    """The step-by-step engine and the fixed-shape one over the same model."""
    plain = LocalEngine(model, tokenizer, NativeDecoder(model, dtype=dtype))
    decoder = NativeDecoder(model, dtype=dtype)
    return plain, LocalEngine(model, tokenizer, decoder, static=StaticDecoding(decoder, graphs=False))


def test_buckets_are_powers_of_two_from_two():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 64, 65, 1000)] == [2, 2, 4, 8, 64, 128, 1024]


@pytest.mark.parametrize("arch,kv_heads", [("llama", None), ("qwen2", 2)], ids=["llama-mha", "qwen2-gqa"])
def test_greedy_tokens_and_logprobs_equal_the_step_by_step_loop(tokenizer, arch, kv_heads):
    model = tiny_model(tokenizer, arch, kv_heads=kv_heads)
    plain, static = engines(model, tokenizer)
    # 5 prompts × 3 = 15 rows in a bucket of 16: one padding row decodes beside them
    sampling = SamplingParams(n=3, max_new_tokens=12, greedy=True)
    expected, got = (
        plain.generate(encode(tokenizer, PROMPTS), sampling),
        static.generate(encode(tokenizer, PROMPTS), sampling),
    )
    assert torch.equal(got.response_ids, expected.response_ids)
    assert got.finish_reasons == expected.finish_reasons
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.logprobs, full_forward_logprobs(model, got), atol=1e-5, rtol=0)


def test_sampled_rows_stop_and_the_tail_runs_in_a_smaller_bucket(tokenizer):
    model = tiny_model(tokenizer, seed=1)
    _, static = engines(model, tokenizer)
    # most rows stop within a few tokens: the live ones are gathered into smaller buckets
    sampling = SamplingParams(n=8, max_new_tokens=24, temperature=1.3, stop_token_ids=COMMON, seed=3)
    widths = []
    original = static.static._decode_step
    static.static._decode_step = lambda width, span, rules: (widths.append(width), original(width, span, rules))
    out = static.generate(encode(tokenizer, PROMPTS), sampling)
    check_bookkeeping(out, (*COMMON, tokenizer.eos_token_id), 24, tokenizer.pad_token_id)
    assert "stop" in out.finish_reasons
    assert widths[0] == 64 and min(widths) < 64  # 40 rows in 64, then fewer
    # a compacted row's log-probs are still its own: the trainer's full forward agrees
    torch.testing.assert_close(out.logprobs, full_forward_logprobs(model, out, 1.3), atol=1e-5, rtol=0)
    again = static.generate(encode(tokenizer, PROMPTS), sampling)
    assert torch.equal(again.response_ids, out.response_ids)  # same seed, same tokens
    other = static.generate(encode(tokenizer, PROMPTS), SamplingParams(**{**sampling.__dict__, "seed": 4}))
    assert not torch.equal(other.response_ids, out.response_ids)


@pytest.mark.parametrize("every", [1, 5], ids=["every-step", "every-5-steps"])
def test_stop_strings_end_the_rows_where_the_step_by_step_loop_ends_them(tokenizer, every):
    model = tiny_model(tokenizer, seed=2)  # greedy: 'V<G.LywLyw…', 'V<G=B=B=B…', 'Hz:Hz:…' (no stop)
    plain, static = engines(model, tokenizer)
    static.static.check_every = every  # a GPU looks every few steps: the stop is placed where it happened
    strings = ("wL", " p", "B=B=B")  # completed by the 2nd, 3rd, 5th token of a string: rows end at different steps
    sampling = SamplingParams(n=3, max_new_tokens=20, greedy=True, stop_strings=strings)
    expected, got = (
        plain.generate(encode(tokenizer, PROMPTS), sampling),
        static.generate(encode(tokenizer, PROMPTS), sampling),
    )
    assert "stop" in got.finish_reasons and "length" in got.finish_reasons
    assert got.finish_reasons == expected.finish_reasons
    assert torch.equal(got.response_ids, expected.response_ids)
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_a_weight_update_is_seen_by_the_next_batch(tokenizer):
    model = tiny_model(tokenizer)
    _, static = engines(model, tokenizer)
    sampling = SamplingParams(n=2, max_new_tokens=8, greedy=True)
    before = static.generate(encode(tokenizer), sampling)
    with torch.no_grad():  # an optimizer step writes in place; the buffers are kept across batches
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    after = static.generate(encode(tokenizer), sampling)
    fresh, _ = engines(model, tokenizer)
    assert torch.equal(after.response_ids, fresh.generate(encode(tokenizer), sampling).response_ids)
    assert not torch.equal(after.response_ids, before.response_ids)


def test_bf16_copies_decode_near_the_float32_masters(tokenizer):
    model = tiny_model(tokenizer)
    _, static = engines(model, tokenizer, dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert static.decoder.embed.dtype == torch.bfloat16 and static.decoder.layers[0].o.dtype == torch.bfloat16
    out = static.generate(encode(tokenizer), SamplingParams(n=2, max_new_tokens=8, seed=0))
    gap = (out.logprobs - full_forward_logprobs(model, out)).abs().max()
    assert 0 < gap < 0.1  # bf16 rounding, not another model


def test_a_batch_without_stops_is_not_cut_by_the_last_batchs_stops(tokenizer):
    model = tiny_model(tokenizer, seed=1)
    _, static = engines(model, tokenizer)
    stopping = SamplingParams(n=8, max_new_tokens=12, stop_token_ids=COMMON, seed=0)
    assert "stop" in static.generate(encode(tokenizer, PROMPTS), stopping).finish_reasons
    static.eos_id = None  # nothing can end the next batch's rows: every one runs the full length
    out = static.generate(encode(tokenizer, PROMPTS), SamplingParams(n=8, max_new_tokens=12, seed=0))
    assert out.finish_reasons == ["length"] * len(out) and bool((out.response_lengths == 12).all())
