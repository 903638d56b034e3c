"""Interruptible generation (rollout.interrupt, docs/algorithms.md §8.2): a generation in flight
takes newer weights at a token boundary, recomputes its KV cache under them and records the
version of every token."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.rollout.engine import build_engine
from posttrain.rollout.process_engine import ProcessEngine
from posttrain.rollout.types import SamplingParams
from posttrain.rollout.weight_mailbox import SharedMailbox, ThreadMailbox
from tests.rollout.conftest import encode, full_forward_logprobs, tiny_model
from tests.rollout.test_engine import COMMON

KINDS = ["native", "transformers"]


class ScheduledMailbox(ThreadMailbox):
    """Holds a post back until the ``visible_at``-th ``take_newer`` call: the engine asks once
    before its prefill (call 0) and once after each sampled step t (call t + 1), so the tokens
    from step ``visible_at`` on are the new weights'."""

    def __init__(self, visible_at: int) -> None:
        super().__init__()
        self.visible_at, self.calls = visible_at, 0

    def take_newer(self, version, model):
        self.calls += 1
        return super().take_newer(version, model) if self.calls > self.visible_at else None


def new_weights(tokenizer):
    return dict(tiny_model(tokenizer, "qwen2", seed=1, kv_heads=2).named_parameters())


def with_weights(model, weights):
    """A copy of ``model`` holding ``weights`` (parameters by name; tied ones appear once)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return model


def check_versions_and_logprobs(out, old_model, new_model, switch: int, old: int, new: int, temperature=1.0):
    """Tokens before ``switch`` were sampled by ``old_model`` (version ``old``), the rest by
    ``new_model``: the engine's log-probs equal each model's full forward pass over the final
    sequence, which a KV cache kept from the old weights would not give."""
    mask = out.response_mask.bool()
    before = mask.clone()
    before[:, switch:] = False
    after = mask & ~before
    assert after.any() and before.any()
    versions = out.extras["token_versions"]
    assert versions[before].eq(old).all() and versions[after].eq(new).all()
    assert out.policy_version.eq(old).all()  # a sample is as old as its oldest token
    old_lp = full_forward_logprobs(old_model, out, temperature)
    new_lp = full_forward_logprobs(new_model, out, temperature)
    assert (out.logprobs - old_lp)[before].abs().max() < 1e-5
    assert (out.logprobs - new_lp)[after].abs().max() < 1e-5
    assert (out.logprobs - old_lp)[after].abs().max() > 1e-2  # the two models really differ there


@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_switches_weights_at_a_token_boundary(tokenizer, kind):
    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    old_model, weights = copy.deepcopy(model), new_weights(tokenizer)
    sampling = SamplingParams(n=2, max_new_tokens=12, seed=3, temperature=0.8)
    plain = build_engine(copy.deepcopy(model), tokenizer, kind).generate(encode(tokenizer), sampling)

    mailbox = ScheduledMailbox(visible_at=4)
    engine = build_engine(model, tokenizer, kind, policy_version=5, mailbox=mailbox)
    engine.offer_weights(6, weights)
    out = engine.generate(encode(tokenizer), sampling)

    # the same draws: up to the switch the tokens are the uninterrupted run's
    assert torch.equal(out.response_ids[:, :4], plain.response_ids[:, :4])
    new_model = with_weights(old_model, weights)
    check_versions_and_logprobs(out, old_model, new_model, switch=4, old=5, new=6, temperature=0.8)
    assert engine.policy_version == 6
    # the next generation starts with the new weights and takes nothing more
    again = engine.generate(encode(tokenizer), sampling)
    assert again.extras["token_versions"].eq(6).all() and again.policy_version.eq(6).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_switch_after_finished_rows_were_dropped(tokenizer, kind):
    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    old_model, weights = copy.deepcopy(model), new_weights(tokenizer)
    mailbox = ScheduledMailbox(visible_at=3)
    engine = build_engine(model, tokenizer, kind, mailbox=mailbox)
    dropped = []
    select = engine.decoder.select
    engine.decoder.select = lambda rows: (dropped.append(len(rows)), select(rows))
    engine.offer_weights(1, weights)
    sampling = SamplingParams(n=4, max_new_tokens=12, seed=2, stop_token_ids=COMMON)
    out = engine.generate(encode(tokenizer), sampling)
    assert dropped and dropped[0] < len(out), "no finished row was dropped before the switch"
    new_model = with_weights(old_model, weights)
    check_versions_and_logprobs(out, old_model, new_model, switch=3, old=0, new=1)


def test_no_mailbox_no_versions_and_offers_refused(tokenizer):
    engine = build_engine(tiny_model(tokenizer), tokenizer, "native")
    out = engine.generate(encode(tokenizer), SamplingParams(max_new_tokens=4, seed=0))
    assert "token_versions" not in out.extras
    with pytest.raises(RuntimeError, match="without a weight mailbox"):
        engine.offer_weights(1, {})


def test_shared_mailbox_stages_only_its_own_tensors(tokenizer):
    model = tiny_model(tokenizer)
    name, param = next(iter(model.named_parameters()))
    mailbox = SharedMailbox({name: param})
    assert mailbox.take_newer(0, model) is None  # nothing posted
    with pytest.raises(KeyError, match="stages no tensor"):
        mailbox.post(1, {"not.a.parameter": param})
    mailbox.post(2, {name: torch.zeros_like(param)})
    assert mailbox.take_newer(2, model) is None  # not newer than what the engine has
    assert mailbox.take_newer(1, model) == 2 and dict(model.named_parameters())[name].eq(0).all()


def test_the_rollout_process_takes_offered_weights(tokenizer):
    """Offered before a generation, the child starts it with them: the tokens a local engine
    holding the new weights samples, all of version 1; the shared copy now holds them."""
    model = tiny_model(tokenizer, "qwen2", kv_heads=2)
    weights = new_weights(tokenizer)
    new_model = with_weights(model, weights)
    sampling = SamplingParams(n=2, max_new_tokens=10, seed=4)
    threads = torch.get_num_threads()  # the child decodes with 1 thread: so does this reference
    torch.set_num_threads(1)
    try:
        expected = build_engine(new_model, tokenizer, "native").generate(encode(tokenizer), sampling)
    finally:
        torch.set_num_threads(threads)

    names = [name for name, _ in model.named_parameters()]
    remote = ProcessEngine(copy.deepcopy(model), tokenizer, kind="native", interruptible=names)
    try:
        first = remote.generate(encode(tokenizer), sampling)
        assert first.extras["token_versions"].eq(0).all()
        remote.offer_weights(1, weights)
        out = remote.generate(encode(tokenizer), sampling)
    finally:
        remote.close()
    assert torch.equal(out.response_ids, expected.response_ids)
    assert out.extras["token_versions"].eq(1).all() and out.policy_version.eq(1).all()
    assert remote.policy_version == 1
    torch.testing.assert_close(dict(remote.model.named_parameters()), dict(new_model.named_parameters()))
