"""Rollout engines: equal to transformers, exact log-probs, reproducible, correct bookkeeping."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.tasks.reverse import make_prompt
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.types import RolloutEngine, Rollouts, SamplingParams

NAMES = ["sean", "akshita", "joel"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def model_for(tokenizer, arch="llama", seed=0):
    model = build_tiny_causal_lm(
        len(tokenizer), arch=arch, layers=2, hidden=64, heads=4, seed=seed, tokenizer=tokenizer
    ).eval()
    if arch == "qwen2":  # Qwen2 has q/k/v biases; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.5)
    return model


def prompts(tokenizer, names=NAMES):
    return [tokenizer(make_prompt(n), add_special_tokens=False)["input_ids"] for n in names]


def full_forward_logprobs(model, rollouts: Rollouts, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float() / temperature
    start = rollouts.prompt_ids.shape[1]
    full = torch.log_softmax(logits[:, start - 1 : -1], dim=-1)
    return full.gather(-1, rollouts.response_ids.unsqueeze(-1)).squeeze(-1) * rollouts.response_mask


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_logits_equal_transformers_with_left_padding(tokenizer, arch):
    model = model_for(tokenizer, arch)
    decoder = NativeDecoder(model)
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    first = decoder.prefill(ids, mask, max_new_tokens=3)
    nxt = torch.tensor([20, 21])
    second = decoder.decode(nxt)
    ids2 = torch.cat([ids, nxt[:, None]], 1)
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        reference = model(input_ids=ids2, attention_mask=mask2, position_ids=(mask2.cumsum(-1) - 1).clamp(min=0))
    torch.testing.assert_close(first, reference.logits[:, -2], atol=1e-5, rtol=0)
    torch.testing.assert_close(second, reference.logits[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_greedy_equals_transformers_generate(tokenizer, kind):
    model = model_for(tokenizer)
    engine = build_engine(model, tokenizer, kind)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts(tokenizer), SamplingParams(greedy=True, max_new_tokens=10))
    for i, name in enumerate(NAMES):
        encoded = tokenizer(make_prompt(name), add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            expected = model.generate(
                **encoded,
                do_sample=False,
                max_new_tokens=10,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        expected = expected[0, encoded["input_ids"].shape[1] :].tolist()
        got = out.response_ids[i][out.response_mask[i].bool()].tolist()
        assert got == expected[: len(got)] and len(got) == len(expected)


@pytest.mark.parametrize("kind", ["native", "transformers"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_a_full_forward(tokenizer, kind, temperature):
    model = model_for(tokenizer)
    engine = build_engine(model, tokenizer, kind)
    out = engine.generate(
        prompts(tokenizer), SamplingParams(n=4, max_new_tokens=12, temperature=temperature, top_p=0.9, seed=1)
    )
    error = (out.logprobs - full_forward_logprobs(model, out, temperature)).abs().max()
    assert error < 1e-5
    assert torch.all(out.logprobs[out.response_mask == 0] == 0)


def test_seed_reproduces_and_groups_are_prompt_major(tokenizer):
    engine = build_engine(model_for(tokenizer), tokenizer)
    sampling = SamplingParams(n=3, max_new_tokens=8, seed=7)
    a, b = engine.generate(prompts(tokenizer), sampling), engine.generate(prompts(tokenizer), sampling)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    c = engine.generate(prompts(tokenizer), SamplingParams(n=3, max_new_tokens=8, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and len(a) == 9
    first_prompt = torch.tensor(prompts(tokenizer)[0])
    for row in range(3):
        assert torch.equal(a.prompt_ids[row][a.prompt_mask[row].bool()], first_prompt)


def test_finish_reasons_stop_ids_and_masks(tokenizer):
    engine = build_engine(model_for(tokenizer), tokenizer)
    out = engine.generate(prompts(tokenizer), SamplingParams(n=4, max_new_tokens=6, seed=0))
    for i in range(len(out)):
        n = int(out.response_lengths[i])
        tokens = out.response_ids[i, :n].tolist()
        if out.finish_reasons[i] == "stop":
            assert tokens[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in tokens[:-1]
        else:
            assert n == 6 and tokenizer.eos_token_id not in tokens
        assert torch.all(out.response_ids[i, n:] == tokenizer.pad_token_id)
        assert out.response_mask[i].sum() == n
    assert tokenizer.pad_token_id not in out.response_ids[out.response_mask.bool()].tolist()
    # a stop token id that the model emits often: every row ends at its first occurrence
    common = int(out.response_ids[0, 0])
    stopped = engine.generate(
        prompts(tokenizer), SamplingParams(n=4, max_new_tokens=6, seed=0, stop_token_ids=(common,))
    )
    assert stopped.finish_reasons[0] == "stop" and stopped.response_lengths[0] == 1
    assert out.truncated.tolist() == [r == "length" for r in out.finish_reasons]


def test_stop_strings_end_the_response_on_the_completing_token(tokenizer):
    model = model_for(tokenizer)
    engine = build_engine(model, tokenizer)
    free = engine.generate(prompts(tokenizer), SamplingParams(greedy=True, max_new_tokens=12))
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in free.response_ids[0].tolist()]
    first = next(j for j, piece in enumerate(pieces) if piece)  # special tokens decode to ""
    out = engine.generate(
        prompts(tokenizer), SamplingParams(greedy=True, max_new_tokens=12, stop_strings=(pieces[first],))
    )
    assert out.finish_reasons[0] == "stop" and int(out.response_lengths[0]) == first + 1


def test_left_padded_batch_equals_one_by_one(tokenizer):
    engine = build_engine(model_for(tokenizer), tokenizer)
    batch = engine.generate(prompts(tokenizer), SamplingParams(greedy=True, max_new_tokens=8))
    for i, name in enumerate(NAMES):
        alone = engine.generate(prompts(tokenizer, [name]), SamplingParams(greedy=True, max_new_tokens=8))
        n = int(alone.response_lengths[0])
        assert batch.response_ids[i, :n].tolist() == alone.response_ids[0, :n].tolist()
        torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0, :n], atol=1e-5, rtol=0)


def test_weight_updates_reach_the_engine(tokenizer):
    model = model_for(tokenizer)
    engine = build_engine(model, tokenizer, "native")
    sampling = SamplingParams(n=2, max_new_tokens=8, seed=3)
    before = engine.generate(prompts(tokenizer), sampling)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.train()
    loss = model(torch.tensor([prompts(tokenizer)[0]]), labels=torch.tensor([prompts(tokenizer)[0]])).loss
    loss.backward()
    optimizer.step()  # colocated: the engine notices the in-place update by itself
    after = engine.generate(prompts(tokenizer), sampling)
    assert model.training  # generation restored the mode
    assert (after.logprobs - full_forward_logprobs(model.eval(), after)).abs().max() < 1e-5
    assert not torch.equal(before.logprobs, after.logprobs)
    # a state dict from elsewhere (another process) is copied in
    other = model_for(tokenizer, seed=5)
    engine.update_weights(7, other.state_dict())
    moved = engine.generate(prompts(tokenizer), sampling)
    assert moved.policy_version.tolist() == [7] * len(moved)
    assert (moved.logprobs - full_forward_logprobs(other, moved)).abs().max() < 1e-5


def test_engine_choice_errors(tokenizer):
    model = model_for(tokenizer)
    with pytest.raises(ValueError, match="valid: auto, native, transformers"):
        build_engine(model, tokenizer, "vllm2")
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    model.config.rope_scaling = model.config.rope_parameters
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        build_engine(model, tokenizer, "native")
    assert type(build_engine(model, tokenizer, "auto").decoder).__name__ == "TransformersDecoder"
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingParams(temperature=0.0)
