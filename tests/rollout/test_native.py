"""The native decoder computes what transformers computes, and refuses what it cannot."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from posttrain.rollout import native
from posttrain.rollout.engine import build_engine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.products import can_pack
from posttrain.rollout.projections import unsupported_reason
from tests.rollout.conftest import tiny_model

MKL = can_pack(torch.device("cpu"), torch.float32)
# the three ways a decoding step multiplies (rollout/products.py); each is chosen by size and
# machine, and every one must compute the same
PRODUCTS = [
    "plain",
    "weight-major",
    pytest.param("packed", marks=pytest.mark.skipif(not MKL, reason="this PyTorch has no MKL (aarch64 wheels)")),
]


def multiply(decoder: NativeDecoder, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``decoder``'s steps multiply ``way``; packed: for every batch, however short."""
    decoder.products.weight_major = way == "weight-major"
    decoder.products.packing = way == "packed"
    monkeypatch.setattr(native, "PACK_FROM_ROW_STEPS", 0)


def transformers_logits(model, prompts, mask, continuations, repeats):
    """transformers' logits of each prompt's ``repeats`` samples continued by ``continuations``."""
    ids = torch.cat([prompts.repeat_interleave(repeats, 0), continuations], 1)
    full_mask = torch.cat([mask.repeat_interleave(repeats, 0), torch.ones_like(continuations)], 1)
    with torch.no_grad():
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids, attention_mask=full_mask, position_ids=positions).logits


@pytest.mark.parametrize("way", PRODUCTS)
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha-untied", "gqa-tied-theta500"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_transformers_on_a_left_padded_batch(tokenizer, arch, kv_heads, way, monkeypatch):
    model = tiny_model(tokenizer, arch, kv_heads=kv_heads)
    decoder = NativeDecoder(model)
    multiply(decoder, way, monkeypatch)
    decoder.LOGIT_CHUNK = 7  # the output layer in several slices, the last one partial
    prompts = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13], [0, 14, 15, 16, 17, 18]])
    mask = (prompts != 0).long()
    repeats, steps = 2, 4
    # each prompt's two samples continue with different tokens
    continuations = torch.randint(4, len(tokenizer), (3 * repeats, steps), generator=torch.Generator().manual_seed(0))
    logits = [decoder.prefill(prompts, mask, max_new_tokens=steps, repeats=repeats)]
    logits += [decoder.decode(continuations[:, t]).clone() for t in range(steps)]  # decode reuses its buffer
    reference = transformers_logits(model, prompts, mask, continuations, repeats)
    for t, got in enumerate(logits):
        torch.testing.assert_close(got, reference[:, prompts.shape[1] - 1 + t], atol=1e-5, rtol=0)
    assert decoder.products.rows == (6 if way == "packed" else 0)  # the packs were what multiplied


@pytest.mark.skipif(not MKL, reason="this PyTorch has no MKL (aarch64 wheels)")
def test_packed_weights_are_made_when_a_batch_repays_them_and_never_outlive_the_weights(tokenizer, monkeypatch):
    model = tiny_model(tokenizer, "llama")
    decoder = NativeDecoder(model)
    decoder.products.packing = True
    prompts = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = (prompts != 0).long()
    tokens = torch.tensor([12, 13, 14, 15])

    # 4 rows × 3 steps to go: packing pays from 12 row-steps, not from 13
    monkeypatch.setattr(native, "PACK_FROM_ROW_STEPS", 13)
    decoder.prefill(prompts, mask, max_new_tokens=4, repeats=2)
    decoder.decode(tokens)
    assert decoder.products.rows == 0
    monkeypatch.setattr(native, "PACK_FROM_ROW_STEPS", 12)
    decoder.prefill(prompts, mask, max_new_tokens=4, repeats=2)
    decoder.decode(tokens)
    assert decoder.products.rows == 4

    # an optimizer-like step rewrites the weights in place (same addresses): the next batch must
    # not multiply by packs of the old values
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    logits = [decoder.prefill(prompts, mask, max_new_tokens=4, repeats=2)]
    assert decoder.products.rows == 0
    logits.append(decoder.decode(tokens).clone())
    assert decoder.products.rows == 4
    reference = transformers_logits(model, prompts, mask, tokens[:, None], 2)
    for t, got in enumerate(logits):
        torch.testing.assert_close(got, reference[:, prompts.shape[1] - 1 + t], atol=1e-5, rtol=0)
    decoder.release()
    assert decoder.products.rows == 0


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_a_prefix_all_prompts_share_is_encoded_once_and_gives_transformers_logits(tokenizer, kv_heads):
    model = tiny_model(tokenizer, "qwen2", kv_heads=kv_heads)
    decoder = NativeDecoder(model)
    decoder.MIN_SHARED = 4
    system = [5, 6, 7, 8, 9, 10]  # a system message every prompt starts with, then each its own
    rows = [[*system, 11, 12, 13], [*system, 14], [*system, 11, 15], [*system, 11, 12, 13, 16, 17]]
    width = max(map(len, rows))
    prompts = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (prompts != 0).long()
    repeats, steps = 2, 3
    continuations = torch.randint(4, len(tokenizer), (4 * repeats, steps), generator=torch.Generator().manual_seed(1))
    logits = [decoder.prefill(prompts, mask, max_new_tokens=steps, repeats=repeats)]
    # the shared tokens (here 6, the longest prefix that leaves each prompt one of its own) once, the rest per prompt
    assert decoder.prefilled_tokens == len(system) + sum(len(r) - len(system) for r in rows)
    logits += [decoder.decode(continuations[:, t]).clone() for t in range(steps)]
    reference = transformers_logits(model, prompts, mask, continuations, repeats)
    for t, got in enumerate(logits):
        torch.testing.assert_close(got, reference[:, width - 1 + t], atol=1e-5, rtol=0)
    # prompts alike in fewer than MIN_SHARED tokens are encoded whole, as before
    decoder.MIN_SHARED = 7
    decoder.prefill(prompts, mask, max_new_tokens=steps)
    assert decoder.prefilled_tokens == int(mask.sum())


@pytest.mark.parametrize("way", PRODUCTS)
@pytest.mark.parametrize(
    "drops",
    [{1: [0, 2, 3, 5], 2: [1, 3]}, {1: [5, 0, 3, 2], 2: [0, 2]}],
    ids=["ascending-in-place", "reordered-then-ascending"],
)
def test_dropping_rows_keeps_the_others_exact(tokenizer, way, drops, monkeypatch):
    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    decoder, reference = NativeDecoder(model), NativeDecoder(model)
    multiply(decoder, way, monkeypatch)  # packed: packed again for each smaller batch
    multiply(reference, way, monkeypatch)
    prompts = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11], [0, 0, 12, 13]])
    mask = (prompts != 0).long()
    steps = 4
    tokens = torch.randint(4, len(tokenizer), (steps, 6), generator=torch.Generator().manual_seed(0))
    decoder.prefill(prompts, mask, max_new_tokens=steps, repeats=2)
    reference.prefill(prompts, mask, max_new_tokens=steps, repeats=2)
    rows = torch.arange(6)  # the reference rows the decoder still runs, in its order
    for t in range(steps):
        expected = reference.decode(tokens[t]).clone()
        torch.testing.assert_close(decoder.decode(tokens[t, rows]), expected[rows], atol=1e-6, rtol=0)
        if t in drops:  # positions among the decoder's current rows
            decoder.select(torch.tensor(drops[t]))
            rows = rows[drops[t]]
    assert len(rows) == 2


def test_unsupported_configs_are_named(tokenizer):
    assert unsupported_reason(tiny_model(tokenizer, "llama")) is None
    assert unsupported_reason(tiny_model(tokenizer, "qwen2", kv_heads=2)) is None

    yarn = tiny_model(tokenizer, "llama")
    yarn.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    assert "rope_type 'yarn'" in unsupported_reason(yarn)

    window = tiny_model(tokenizer, "qwen2")
    window.config.use_sliding_window = True
    assert "sliding-window" in unsupported_reason(window)

    biased = tiny_model(tokenizer, "llama")
    biased.model.layers[0].self_attn.o_proj.bias = nn.Parameter(torch.zeros(64))
    assert "biases" in unsupported_reason(biased)

    wrapped = tiny_model(tokenizer, "llama")
    wrapped.model.layers[1].mlp.up_proj = nn.Sequential(wrapped.model.layers[1].mlp.up_proj)
    assert "nn.Linear" in unsupported_reason(wrapped)

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    assert "model_type 'gpt2'" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="native' cannot run this model: model_type 'gpt2'"):
        build_engine(gpt2, tokenizer, "native")
    assert type(build_engine(gpt2, tokenizer, "auto").decoder).__name__ == "TransformersDecoder"
    with pytest.raises(ValueError, match="valid: auto, native, transformers"):
        build_engine(gpt2, tokenizer, "vllm2")
