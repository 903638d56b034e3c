"""A compiled decoding step (``rollout.compile_step``) samples what the eager step samples.

The fixed-shape step (static_decode.py) with its layers compiled by ``torch.compile`` against the
same step run eagerly, on the CPU: tokens for a fixed seed, log-probs, the weights of the last
update, and one compile for every batch width and attention span. The same checks on a GPU, where
the compiled step is what a CUDA graph replays, are benchmarks/gpu_step.py's. The first test in
a process pays the compile (~10–30 s on 2 cores); the others reuse it.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from posttrain.rollout.engine import LocalEngine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.static_decode import StaticDecoding
from posttrain.rollout.types import SamplingParams
from tests.rollout.conftest import encode, full_forward_logprobs, tiny_model
from tests.rollout.test_engine import COMMON, check_bookkeeping
from tests.rollout.test_static_decode import PROMPTS


def fixed_shape_engine(model, tokenizer, compiled: bool) -> LocalEngine:
    decoder = NativeDecoder(model)
    return LocalEngine(model, tokenizer, decoder, static=StaticDecoding(decoder, graphs=False, compiled=compiled))


def test_the_compiled_step_samples_the_eager_steps_tokens_in_one_compile(tokenizer):
    model = tiny_model(tokenizer, seed=1)
    eager, compiled = (fixed_shape_engine(model, tokenizer, c) for c in (False, True))
    # most rows stop within a few tokens: the batch runs in 64 rows, then in smaller buckets
    sampling = SamplingParams(n=8, max_new_tokens=24, temperature=1.3, stop_token_ids=COMMON, seed=3)
    expected = eager.generate(encode(tokenizer, PROMPTS), sampling)
    got = compiled.generate(encode(tokenizer, PROMPTS), sampling)
    check_bookkeeping(got, (*COMMON, tokenizer.eos_token_id), 24, tokenizer.pad_token_id)
    assert "stop" in got.finish_reasons
    # fused kernels round differently: log-probs within float32 noise, and so the same draws
    assert torch.equal(got.response_ids, expected.response_ids)
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.logprobs, full_forward_logprobs(model, got, 1.3), atol=1e-5, rtol=0)
    # other widths (3 prompts × 5) and spans (40 tokens), greedy: compiled for none of them again
    graphs = counters["stats"]["unique_graphs"]
    greedy = SamplingParams(n=5, max_new_tokens=40, greedy=True)
    expected = eager.generate(encode(tokenizer, PROMPTS[:3]), greedy)
    got = compiled.generate(encode(tokenizer, PROMPTS[:3]), greedy)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(got.response_ids, expected.response_ids)
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_the_compiled_step_reads_the_weights_of_the_last_update(tokenizer):
    model = tiny_model(tokenizer)
    compiled = fixed_shape_engine(model, tokenizer, True)
    sampling = SamplingParams(n=2, max_new_tokens=8, greedy=True)
    before = compiled.generate(encode(tokenizer), sampling)
    with torch.no_grad():  # an optimizer step writes in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    after = compiled.generate(encode(tokenizer), sampling)
    assert not torch.equal(after.response_ids, before.response_ids)
    fresh = LocalEngine(model, tokenizer, NativeDecoder(model))  # step by step, from the new weights
    expected = fresh.generate(encode(tokenizer), sampling)
    assert torch.equal(after.response_ids, expected.response_ids)
    torch.testing.assert_close(after.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    # a parameter replaced outright (not written in place) is read from its new tensor too
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1.0)
    replaced = compiled.generate(encode(tokenizer), sampling)
    expected = LocalEngine(model, tokenizer, NativeDecoder(model)).generate(encode(tokenizer), sampling)
    assert torch.equal(replaced.response_ids, expected.response_ids)
    torch.testing.assert_close(replaced.logprobs, expected.logprobs, atol=1e-5, rtol=0)
