"""The shared sampling loop: agrees with transformers, exact log-probs, reproducible, correct bookkeeping."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.engine import LocalEngine, build_engine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.types import RolloutEngine, SamplingParams
from tests.rollout.conftest import NAMES, encode, full_forward_logprobs, tiny_model

KINDS = ["native", "transformers"]
COMMON = tuple(range(4, 24))  # a quarter of the vocabulary: as stop ids, most rows end within a few tokens


class Boosted:
    """A decoder whose logits favour one token by ``amount`` — to make the loop face it."""

    def __init__(self, inner, token: int, amount: float = 20.0) -> None:
        self.inner, self.token, self.amount = inner, token, amount

    def _boost(self, logits):
        return logits.index_add(-1, torch.tensor([self.token]), torch.full((logits.shape[0], 1), self.amount))

    def refresh(self):
        self.inner.refresh()

    def prefill(self, *args, **kwargs):
        return self._boost(self.inner.prefill(*args, **kwargs))

    def decode(self, tokens):
        return self._boost(self.inner.decode(tokens))

    def select(self, rows):
        self.inner.select(rows)

    def release(self):
        return self.inner.release()


def check_bookkeeping(out, stop_ids, max_new_tokens, pad_id):
    """Every row: the mask covers exactly the generated tokens, the stop token included."""
    for i in range(len(out)):
        n = int(out.response_lengths[i])
        tokens = out.response_ids[i, :n].tolist()
        assert not set(tokens[:-1]) & set(stop_ids)  # nothing stopped it earlier
        if out.finish_reasons[i] == "stop":
            assert tokens[-1] in stop_ids
        else:
            assert n == max_new_tokens and tokens[-1] not in stop_ids
        assert out.response_mask[i, :n].eq(1).all() and out.response_mask[i, n:].eq(0).all()
        assert out.response_ids[i, n:].eq(pad_id).all() and out.logprobs[i, n:].eq(0).all()
        assert out.logprobs[i, :n].lt(0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers_generate(tokenizer, kind):
    model = tiny_model(tokenizer)
    engine = build_engine(model, tokenizer, kind)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(encode(tokenizer), SamplingParams(greedy=True, max_new_tokens=10))
    for i, prompt in enumerate(encode(tokenizer)):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=10, pad_token_id=tokenizer.pad_token_id
            )[0, len(prompt) :].tolist()
        assert out.response_ids[i, : int(out.response_lengths[i])].tolist() == expected


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(n=4, max_new_tokens=12, seed=1),
        SamplingParams(n=4, max_new_tokens=12, seed=2, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05),
    ],
    ids=["plain", "tempered-truncated"],
)
def test_logprobs_equal_a_full_forward_pass(tokenizer, kind, sampling):
    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    engine = build_engine(model, tokenizer, kind)
    dropped = []
    select = engine.decoder.select
    engine.decoder.select = lambda rows: (dropped.append(len(rows)), select(rows))
    sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": COMMON})
    out = engine.generate(encode(tokenizer), sampling)
    assert dropped, "no finished rows were dropped: this test should cover that path"
    assert "stop" in out.finish_reasons and out.response_lengths.max() > 3
    error = (out.logprobs - full_forward_logprobs(model, out, sampling)).abs().max()
    assert error < 1e-5


def test_fallback_agrees_with_native_under_greedy(tokenizer):
    for model in (tiny_model(tokenizer, "llama"), tiny_model(tokenizer, "qwen2", kv_heads=2)):
        sampling = SamplingParams(greedy=True, max_new_tokens=12, n=2)
        native = build_engine(model, tokenizer, "native").generate(encode(tokenizer), sampling)
        fallback = build_engine(model, tokenizer, "transformers").generate(encode(tokenizer), sampling)
        assert torch.equal(native.response_ids, fallback.response_ids)
        torch.testing.assert_close(native.logprobs, fallback.logprobs, atol=1e-5, rtol=0)


def test_seed_reproduces_and_groups_are_prompt_major(tokenizer):
    engine = build_engine(tiny_model(tokenizer), tokenizer)
    sampling = SamplingParams(n=3, max_new_tokens=8, seed=7)
    a, b = engine.generate(encode(tokenizer), sampling), engine.generate(encode(tokenizer), sampling)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    c = engine.generate(encode(tokenizer), SamplingParams(n=3, max_new_tokens=8, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and len(a) == 9
    for row in range(9):
        prompt = a.prompt_ids[row][a.prompt_mask[row].bool()].tolist()
        assert prompt == encode(tokenizer)[row // 3]
    # the samples of a group differ from each other
    assert len({tuple(r) for r in a.response_ids[:3].tolist()}) > 1


def test_stop_ids_and_length_set_finish_reasons_and_masks(tokenizer):
    engine = build_engine(tiny_model(tokenizer), tokenizer)
    stops = COMMON[:12]
    out = engine.generate(encode(tokenizer), SamplingParams(n=6, max_new_tokens=6, seed=0, stop_token_ids=stops))
    assert set(out.finish_reasons) == {"stop", "length"}
    check_bookkeeping(out, set(stops) | {tokenizer.eos_token_id}, 6, tokenizer.pad_token_id)
    assert out.truncated.tolist() == [r == "length" for r in out.finish_reasons]
    assert out.policy_version.tolist() == [0] * len(out)


def test_eos_ends_a_response_and_pad_is_never_sampled(tokenizer):
    model = tiny_model(tokenizer)
    engine = LocalEngine(model, tokenizer, Boosted(NativeDecoder(model), tokenizer.eos_token_id, amount=3.0))
    out = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=8, seed=0))
    assert "stop" in out.finish_reasons
    check_bookkeeping(out, {tokenizer.eos_token_id}, 8, tokenizer.pad_token_id)
    # pad made overwhelmingly likely: the loop must still never choose it
    engine = LocalEngine(model, tokenizer, Boosted(NativeDecoder(model), tokenizer.pad_token_id))
    for sampling in (SamplingParams(n=4, max_new_tokens=8, seed=0), SamplingParams(greedy=True, max_new_tokens=8)):
        out = engine.generate(encode(tokenizer), sampling)
        assert tokenizer.pad_token_id not in out.response_ids[out.response_mask.bool()].tolist()
        assert out.logprobs[out.response_mask.bool()].lt(-10).all()  # under the unbanned distribution


def test_stop_strings_end_on_the_completing_token(tokenizer):
    engine = build_engine(tiny_model(tokenizer), tokenizer)
    free = engine.generate(encode(tokenizer), SamplingParams(greedy=True, max_new_tokens=12))
    text = tokenizer.decode(free.response_ids[0].tolist(), skip_special_tokens=True)
    stop = text[2:4]  # two characters, two tokens: the match spans tokens
    first = text.index(stop) + len(stop)  # one token per character
    out = engine.generate(encode(tokenizer), SamplingParams(greedy=True, max_new_tokens=12, stop_strings=(stop,)))
    assert out.finish_reasons[0] == "stop" and int(out.response_lengths[0]) == first
    assert tokenizer.decode(out.response_ids[0, :first].tolist()).endswith(stop)


def test_left_padded_batch_equals_one_by_one(tokenizer):
    engine = build_engine(tiny_model(tokenizer, "qwen2", kv_heads=2), tokenizer)
    batch = engine.generate(encode(tokenizer), SamplingParams(greedy=True, max_new_tokens=8))
    for i, name in enumerate(NAMES):
        alone = engine.generate(encode(tokenizer, [name]), SamplingParams(greedy=True, max_new_tokens=8))
        n = int(alone.response_lengths[0])
        assert batch.response_ids[i, :n].tolist() == alone.response_ids[0, :n].tolist()
        torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0, :n], atol=1e-5, rtol=0)


def sgd_step(model, tokenizer):
    prompt = torch.tensor([encode(tokenizer)[0]])
    model.train()
    model(prompt, labels=prompt).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.zero_grad()


@pytest.mark.parametrize("kind", KINDS)
def test_weight_updates_reach_the_engine(tokenizer, kind):
    model = tiny_model(tokenizer)
    engine = build_engine(model, tokenizer, kind)
    sampling = SamplingParams(n=2, max_new_tokens=8, seed=3)
    before = engine.generate(encode(tokenizer), sampling)
    sgd_step(model, tokenizer)  # colocated: the trainer updates the very module the engine holds
    engine.update_weights(1)
    after = engine.generate(encode(tokenizer), sampling)
    assert model.training  # generation restored the mode
    assert not torch.equal(before.logprobs, after.logprobs)
    assert (after.logprobs - full_forward_logprobs(model.eval(), after)).abs().max() < 1e-5
    # writes that bypass the version counter (.data) are picked up by the explicit call
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(1.5)
    engine.update_weights(2)
    scaled = engine.generate(encode(tokenizer), sampling)
    assert (scaled.logprobs - full_forward_logprobs(model, scaled)).abs().max() < 1e-5
    # another process's weights are copied in
    other = tiny_model(tokenizer, seed=5)
    engine.update_weights(7, other.state_dict())
    moved = engine.generate(encode(tokenizer), sampling)
    assert moved.policy_version.tolist() == [7] * len(moved)
    assert (moved.logprobs - full_forward_logprobs(other, moved)).abs().max() < 1e-5


def test_native_notices_an_optimizer_step_by_itself(tokenizer):
    model = tiny_model(tokenizer)
    engine = build_engine(model, tokenizer, "native")
    engine.generate(encode(tokenizer), SamplingParams(max_new_tokens=4, seed=0))
    sgd_step(model, tokenizer)
    out = engine.generate(encode(tokenizer), SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert (out.logprobs - full_forward_logprobs(model.eval(), out)).abs().max() < 1e-5


def test_outputs_carry_no_autograd_state_and_train_with_the_policy(tokenizer):
    model = tiny_model(tokenizer).train()
    out = build_engine(model, tokenizer).generate(encode(tokenizer), SamplingParams(n=2, max_new_tokens=5, seed=0))
    assert model.training and all(p.grad is None for p in model.parameters())
    for tensor in (out.response_ids, out.response_mask, out.logprobs, out.prompt_ids, out.group_ids):
        assert not tensor.requires_grad and not tensor.is_inference()
    # a policy-loss-like product with the mask and the engine log-probs back-propagates
    weight = torch.ones((), requires_grad=True)
    ((weight * out.logprobs).exp() * out.response_mask).sum().backward()
    # d/dw Σ m·exp(w·ℓ) at w = 1 is Σ m·ℓ·exp(ℓ): the engine's values, not a detached constant
    expected = (out.response_mask * out.logprobs * out.logprobs.exp()).sum()
    torch.testing.assert_close(weight.grad, expected)
    assert float(expected) < 0


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_generation_frees_its_cache_and_fused_weights(tokenizer, kind):
    # what a batch built (KV cache, logits buffers, fused weight copies) is not kept beside the
    # trainer's update; the next batch rebuilds it from the weights as they are then
    model = tiny_model(tokenizer)
    engine = build_engine(model, tokenizer, kind)
    sampling = SamplingParams(n=2, max_new_tokens=6, seed=0)
    first = engine.generate(encode(tokenizer), sampling)
    decoder = engine.decoder
    if kind == "native":
        assert decoder.keys is None and decoder.values is None and decoder.logits is None and decoder.layers == []
    else:
        assert decoder.cache is None
    again = engine.generate(encode(tokenizer), sampling)
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.logprobs, again.logprobs)
    if kind == "native":  # the size it reports decides whether the engine hands memory back
        ids = torch.tensor([[5, 6, 7]])
        decoder.prefill(ids, torch.ones_like(ids), max_new_tokens=4, repeats=2)
        cache = decoder.keys.untyped_storage().nbytes() + decoder.values.untyped_storage().nbytes()
        assert decoder.release() > cache and decoder.release() == 0
