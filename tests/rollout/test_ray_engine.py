"""cluster.kind: ray — rollout workers as Ray actors (rollout/ray_engine.py): each worker samples
its contiguous share of the prompts, in a process of its own, exactly as a local engine with
the worker's seed would; new weights reach every worker through the object store; a worker that
dies is started again with the newest weights and its share sampled again, and too many deaths
stop with a message naming the worker."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from posttrain.rollout.engine import build_engine
from posttrain.rollout.ray_engine import SEED_STRIDE, ClusterSection, RayEngine, RayWorkerError, merge_rollouts
from posttrain.rollout.types import SamplingParams
from tests.rollout.conftest import NAMES, encode, tiny_model

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'posttrain[dist]'")
pytestmark = pytest.mark.slow

SAMPLING = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=11)
FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "policy_version")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield
    ray.shutdown()


def ray_engine(model, tokenizer, echo=print, failures=3, interruptible=False) -> RayEngine:
    section = ClusterSection(kind="ray", rollout_workers=2, max_worker_failures=failures)
    return RayEngine(model, tokenizer, section, kind="native", echo=echo, interruptible=interruptible)


def expected(model, tokenizer, prompts, version=0):
    """What the two workers sample: a local engine over each half, with each worker's seed and
    thread count (1: another count rounds the log-probs differently, which can flip a near-tie)."""
    local = build_engine(model, tokenizer, kind="native", policy_version=version)
    half = len(prompts) // 2
    second = dataclasses.replace(SAMPLING, seed=SAMPLING.seed + SEED_STRIDE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        halves = [local.generate(prompts[:half], SAMPLING), local.generate(prompts[half:], second)]
    finally:
        torch.set_num_threads(threads)
    return merge_rollouts(halves, 0)


def assert_same(got, want):
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)
    assert got.finish_reasons == want.finish_reasons


def test_each_worker_samples_its_share_as_a_local_engine_would(cluster, tokenizer):
    model, prompts = tiny_model(tokenizer), encode(tokenizer, (*NAMES, "ada"))
    engine = ray_engine(model, tokenizer)
    try:
        got = engine.generate(prompts, SAMPLING)
        pids = {ray.get(worker.pid.remote()) for worker in engine.workers}
    finally:
        engine.close()
    assert got.group_ids.tolist() == [g for g in range(4) for _ in range(3)]
    assert_same(got, expected(model, tokenizer, prompts))
    assert len(pids) == 2 and os.getpid() not in pids  # two processes of their own


def test_new_weights_reach_every_worker_and_a_killed_worker_restarts_with_them(cluster, tokenizer):
    model, prompts = tiny_model(tokenizer), encode(tokenizer, (*NAMES, "ada"))
    lines: list[str] = []
    engine = ray_engine(model, tokenizer, echo=lines.append)
    try:
        with torch.no_grad():  # the learner's update, in place in the policy the engine was given
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        engine.update_weights(1)
        assert_same(engine.generate(prompts, SAMPLING), expected(model, tokenizer, prompts, version=1))
        ray.kill(engine.workers[1])  # as a node lost or an out-of-memory kill would
        got = engine.generate(prompts, SAMPLING)
    finally:
        engine.close()
    assert_same(got, expected(model, tokenizer, prompts, version=1))  # restarted on version 1's weights
    assert len(lines) == 1 and lines[0].startswith("[ray] rollout worker 1 died")
    assert "started again with policy version 1" in lines[0] and "1 of at most 3 deaths" in lines[0]


def test_weights_offered_to_interruptible_workers_are_taken_and_each_token_keeps_its_version(cluster, tokenizer):
    """rollout.interrupt on Ray: an offer (the trainable weights, by name) reaches every worker
    beside its generation; once taken, the workers sample as a local engine holding the new
    weights would, every token marked with the offered version, the two shares' marks merged."""
    model, prompts = tiny_model(tokenizer), encode(tokenizer, (*NAMES, "ada"))
    engine = ray_engine(model, tokenizer, interruptible=True)
    try:
        first = engine.generate(prompts, SAMPLING)
        newer = copy.deepcopy(model)
        with torch.no_grad():
            for param in newer.parameters():
                param.add_(0.05 * torch.randn_like(param))
        engine.offer_weights(1, dict(newer.named_parameters()))
        ray.get(engine.offers)  # landed in both mailboxes: the next generation starts with them
        got = engine.generate(prompts, SAMPLING)
    finally:
        engine.close()
    assert first.extras["token_versions"].eq(0).all()
    versions, mask = got.extras["token_versions"], got.response_mask.bool()
    assert versions.shape == got.response_ids.shape and versions[mask].eq(1).all()
    assert engine.policy_version == 1
    want = expected(newer, tokenizer, prompts)
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)


def test_more_deaths_than_allowed_stop_naming_the_worker(cluster, tokenizer):
    model, prompts = tiny_model(tokenizer), encode(tokenizer)
    engine = ray_engine(model, tokenizer, failures=0)
    try:
        ray.kill(engine.workers[0])
        with pytest.raises(RayWorkerError, match=r"rollout worker 0 died .*more than cluster.max_worker_failures = 0"):
            engine.generate(prompts, SAMPLING)
    finally:
        engine.close()


def test_an_error_raised_in_a_worker_is_raised_here_not_taken_for_a_death(cluster, tokenizer):
    model = tiny_model(tokenizer)
    lines: list[str] = []
    engine = ray_engine(model, tokenizer, echo=lines.append)
    try:
        with pytest.raises(ValueError, match="every prompt at least one token"):
            engine.generate([encode(tokenizer)[0], []], SAMPLING)  # worker 1 gets the empty prompt
    finally:
        engine.close()
    assert lines == [] and engine.failures == 0
