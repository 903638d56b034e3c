import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from posttrain.models.logprobs import (
    chunked_logprobs,
    response_logprobs,
    scored_logprobs,
    token_entropies,
    token_logprobs,
    token_logprobs_and_entropies,
)


def test_matches_hand_computed_values():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # softmax rows: [1/2, 1/2], [3/4, 1/4]
    tokens = torch.tensor([[1, 1]])
    expected = torch.tensor([[math.log(0.5), math.log(0.25)]])
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)


def test_random_batch_agrees_with_full_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    out = token_logprobs(logits, tokens)
    full = torch.log_softmax(logits, -1)
    for b in range(3):
        for t in range(5):
            torch.testing.assert_close(out[b, t], full[b, t, tokens[b, t]])


def test_low_precision_logits_give_float32():
    logits = torch.randn(2, 3, 7).bfloat16()
    assert token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float32


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(torch.zeros(2, 4, 7), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_naive_on_a_real_vocabulary(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 9, 32_000, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 32_000, (2, 9), generator=g)
    naive = torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 5, 4096):  # chunks that split rows unevenly too
        torch.testing.assert_close(token_logprobs(logits, tokens, chunk_size=chunk), naive, atol=1e-6, rtol=0)


def test_temperature_and_entropy():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 50, generator=g)
    tokens = torch.randint(0, 50, (2, 3), generator=g)
    tempered = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature=0.7, chunk_size=4), tempered)
    probs = torch.softmax(logits, -1)
    naive_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(token_entropies(logits, chunk_size=4), naive_entropy, atol=1e-6, rtol=0)


def test_response_logprobs_match_the_rollout_engine():
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer
    from posttrain.rollout.engine import build_engine
    from posttrain.rollout.types import SamplingParams

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer).eval()
    engine = build_engine(model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("ab", "Reverse the name: x")]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=0))
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask.long()], 1)
    with torch.no_grad():
        logprobs, entropies = response_logprobs(
            model, ids, mask, out.prompt_ids.shape[1], temperature=0.8, with_entropy=True
        )
    torch.testing.assert_close(logprobs * out.response_mask, out.logprobs, atol=1e-5, rtol=0)
    assert entropies.shape == out.logprobs.shape


def naive_logprobs_and_entropy(logits, tokens, temperature=1.0):
    z = logits.float() / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(torch.softmax(z, -1) * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_entropy_equals_naive_on_a_real_vocabulary(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 9, 32_000, generator=g) * 3 + 20).to(dtype)  # + 20: cancellation would show
    tokens = torch.randint(0, 32_000, (2, 9), generator=g)
    naive_lp, naive_h = naive_logprobs_and_entropy(logits, tokens, temperature=0.9)
    for chunk in (1, 5, None):
        lp, h = token_logprobs_and_entropies(logits, tokens, temperature=0.9, chunk_size=chunk, with_entropy=True)
        torch.testing.assert_close(lp, naive_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(h, naive_h, atol=1e-6, rtol=0)
        torch.testing.assert_close(
            token_entropies(logits, temperature=0.9, chunk_size=chunk), naive_h, atol=1e-6, rtol=0
        )


def test_gradients_equal_naive_and_backward_keeps_no_full_vocabulary_tensor():
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 7, 4_000, generator=g) * 2).requires_grad_()
    tokens = torch.randint(0, 4_000, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)
    saved_bytes = []

    def pack(tensor):  # bytes autograd keeps for backward, beyond views of the logits themselves
        if tensor.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            saved_bytes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, h = token_logprobs_and_entropies(logits, tokens, chunk_size=4, with_entropy=True)
    assert sum(saved_bytes) < logits.numel()  # far below one float32 [B, T, V] (4 bytes a logit)
    ((lp + 0.1 * h) * weights).sum().backward()
    chunked_grad, logits.grad = logits.grad, None
    naive_lp, naive_h = naive_logprobs_and_entropy(logits, tokens)
    ((naive_lp + 0.1 * naive_h) * weights).sum().backward()
    torch.testing.assert_close(chunked_grad, logits.grad, atol=1e-6, rtol=0)


def test_the_output_layer_runs_only_at_scored_positions_and_gives_what_it_gives_everywhere():
    """An environment's tokens and padding are never scored: the head skips them (zeros there),
    and where it runs the values and the gradients are those of every position's pass."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, 16, generator=g).requires_grad_()
    head = torch.nn.Linear(16, 50, bias=False)
    tokens = torch.randint(0, 50, (12,), generator=g)
    scored = torch.tensor([1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0], dtype=torch.float32)
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    lp, h = scored_logprobs(hidden, tokens, head, 50, 0.7, 4, True, scored=scored)
    assert sum(seen) == 5  # the five scored positions, in chunks of 4
    ((lp + 0.1 * h) * torch.arange(12.0)).sum().backward()
    grad, hidden.grad = hidden.grad, None
    every_lp, every_h = chunked_logprobs(hidden, tokens, head, 50, 0.7, 4, True)
    ((every_lp + 0.1 * every_h) * scored * torch.arange(12.0)).sum().backward()
    torch.testing.assert_close(lp, every_lp * scored, atol=1e-6, rtol=0)
    torch.testing.assert_close(h, every_h * scored, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, hidden.grad, atol=1e-6, rtol=0)


def tiny_lm(tied: bool):
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 0], [11, 12, 13, 14, 15, 16, 17, 18]])
MASK = (IDS != 0).long()


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_chunks_equal_full_logits(tied):
    model = tiny_lm(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        full = model(input_ids=IDS, attention_mask=MASK, position_ids=(MASK.cumsum(-1) - 1).clamp(min=0)).logits
    naive_lp, naive_h = naive_logprobs_and_entropy(full[:, 2:-1], IDS[:, 3:])
    for chunks in (False, True):
        with torch.no_grad():
            lp, h = response_logprobs(model, IDS, MASK, 3, with_entropy=True, lm_head_chunks=chunks, chunk_size=3)
        torch.testing.assert_close(lp, naive_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(h, naive_h, atol=1e-5, rtol=0)
    lp, _ = response_logprobs(model, IDS, MASK, 3, lm_head_chunks=True, chunk_size=3)
    lp.sum().backward()  # gradients reach the output layer (the embedding, when tied) through the checkpoints
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_response_mask_gives_the_prompt_width_and_zeroes_masked_tokens():
    model = tiny_lm(False)
    response_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 1, 1]])  # tool tokens at 1-2 of row 2
    with torch.no_grad():
        by_start, _ = response_logprobs(model, IDS, MASK, 3, temperature=0.7)
        by_mask, entropy = response_logprobs(
            model, IDS, MASK, response_mask=response_mask, temperature=0.7, with_entropy=True
        )
    torch.testing.assert_close(by_mask, by_start * response_mask)
    assert (entropy[response_mask == 0] == 0).all() and (entropy[response_mask == 1] > 0).all()
    with pytest.raises(ValueError, match="response mask starts at 3"):
        response_logprobs(model, IDS, MASK, 2, response_mask=response_mask)
    with pytest.raises(ValueError, match="give response_start"):
        response_logprobs(model, IDS, MASK)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        response_logprobs(model, IDS, MASK, 3, lm_head_chunks=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prompt_forward_equals_the_full_forward_in_values_and_gradients(arch):
    from posttrain.models.logprobs import shared_prompt_logprobs
    from posttrain.models.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(50, arch=arch, layers=2, hidden=32, heads=4, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts, width, length = 3, 7, 5
    prompt_mask = torch.ones(prompts, width, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding of different widths
    prompt_mask[2, :1] = 0
    prompt_ids = torch.randint(3, 50, (prompts, width), generator=generator).masked_fill(prompt_mask == 0, 0)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0, 1, 2, 0, 1])  # any order, uneven groups
    response_mask = torch.ones(len(index), length)
    response_mask[1, 3:] = 0
    response_mask[5, 1:] = 0
    response_ids = torch.randint(3, 50, (len(index), length), generator=generator).masked_fill(response_mask == 0, 0)
    full_ids = torch.cat([prompt_ids[index], response_ids], 1)
    full_mask = torch.cat([prompt_mask[index], response_mask.long()], 1)

    expected, expected_entropy = response_logprobs(
        model, full_ids, full_mask, response_mask=response_mask, with_entropy=True, temperature=0.7
    )
    shared, shared_entropy = shared_prompt_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, index, with_entropy=True, temperature=0.7
    )
    torch.testing.assert_close(shared, expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(shared_entropy, expected_entropy, atol=2e-6, rtol=0)
    weights = torch.randn(expected.shape, generator=generator)
    grads_full = torch.autograd.grad((expected * weights).sum(), list(model.parameters()))
    grads_shared = torch.autograd.grad((shared * weights).sum(), list(model.parameters()))
    for full, part in zip(grads_full, grads_shared, strict=True):
        torch.testing.assert_close(part, full, atol=1e-5, rtol=1e-4)


def test_shared_prompt_forward_never_builds_the_batch_logits_unless_the_model_transforms_them():
    """With a plain output layer the head sees at most one chunk of rows at a time (the [B, T, V]
    logits never exist); a model that transforms its logits (soft-capping) takes its own forward,
    and both give the same values."""
    from posttrain.models.logprobs import output_layer, shared_prompt_logprobs

    model = tiny_lm(tied=True)
    prompt_ids, prompt_mask = IDS[:, :4], MASK[:, :4]
    index = torch.tensor([0, 0, 1, 1, 1])
    response_ids = torch.randint(3, 300, (5, 6), generator=torch.Generator().manual_seed(1))
    response_mask = torch.ones(5, 6)
    rows_seen: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].reshape(-1, 32).shape[0]))
    assert output_layer(model) is model.lm_head
    args = (model, prompt_ids, prompt_mask, response_ids, response_mask, index)
    chunked, _ = shared_prompt_logprobs(*args, chunk_size=4)
    chunked.sum().backward()  # the backward recomputes each chunk: again at most 4 rows
    assert rows_seen and max(rows_seen) <= 4 and model.lm_head.weight.grad.abs().sum() > 0
    model.config.final_logit_softcapping = 1e9  # a transform (numerically nothing): the model's own logits
    assert output_layer(model) is None
    rows_seen.clear()
    with torch.no_grad():
        whole, _ = shared_prompt_logprobs(*args)
    assert max(rows_seen) > 4
    torch.testing.assert_close(whole, chunked.detach(), atol=1e-5, rtol=0)


def test_shared_prompt_gradients_repeat_exactly_with_several_threads():
    """The prompts' keys and values indexed out to their rows backpropagate as a sum over each
    prompt's rows. Indexed as ``keys[rows]`` (transformers' ``batch_select_indices``), that sum is an
    accumulating ``index_put_``, whose order on a CPU with two threads changes from one backward to
    the next (here 12 of 29 passes over [9, 4, 17, 32] → 64 rows came out different): the same seed
    then trained different weights (tests/examples/conftest.py). Gathered with ``index_select``
    the gradients repeat bit for bit."""
    from posttrain.models.logprobs import shared_prompt_logprobs
    from posttrain.models.tiny import build_tiny_causal_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = build_tiny_causal_lm(60, layers=2, hidden=128, heads=4, seed=0)
        generator = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(3, 60, (9, 17), generator=generator)
        index = torch.randint(0, 9, (64,), generator=generator)
        response_ids = torch.randint(3, 60, (64, 24), generator=generator)
        ones = torch.ones(64, 24)
        weights = torch.randn(64, 24, generator=generator)
        prompt_mask, runs = torch.ones_like(prompt_ids), []
        for _ in range(12):
            logprobs, _ = shared_prompt_logprobs(model, prompt_ids, prompt_mask, response_ids, ones, index)
            runs.append(torch.autograd.grad((logprobs * weights).sum(), list(model.parameters())))
    finally:
        torch.set_num_threads(threads)
    differing = [k for k, run in enumerate(runs[1:], 1) if not all(map(torch.equal, run, runs[0]))]
    assert differing == [], f"backward passes {differing} differ from the first"
