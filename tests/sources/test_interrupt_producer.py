"""Interruptible generation in asynchronous runs (``rollout.interrupt``, docs/algorithms.md §8.2):
the learner offers each new version to the producer's engine, which switches a generation in
flight to it; every token records its version, a sample is as old as its oldest token, and the
admission bound (no sample trained more than η versions after it started) still holds. Such runs
depend on timing, so the checks are containment, not equality; a resume still repeats the steps
whose batches the checkpoint recorded. (The engine's switch itself: tests/rollout/test_interrupt.py.)"""

from __future__ import annotations

import math
import shutil
import threading
import time

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.rollout.weight_mailbox import ThreadMailbox
from posttrain.run.checkpoint import checkpoint_root
from posttrain.sources.async_producer import AsyncProducer, token_version_metrics
from posttrain.sources.recorded import read_batch
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from tests.sources.test_async_producer import NO_KL, SMALL, TINY, deterministic, make_run, vowel_share


def check_contained(batch, step: int, eta: int) -> bool:
    """Every sampled token's version lies between the sample's start (its ``policy_version``, at
    least the admitted k − 1 − η) and the learner's version k − 1, and never goes back along a
    sample. Returns whether some sample mixes versions."""
    mixed = False
    mask = batch.response_mask.bool()
    for versions, sampled, start in zip(batch.token_versions, mask, batch.policy_version.tolist(), strict=True):
        assert start >= max(0, step - 1 - eta), (step, start)
        tokens = versions[sampled]
        if len(tokens) == 0:
            continue
        assert int(tokens.min()) == start and int(tokens.max()) <= step - 1, (step, start, tokens.tolist())
        assert bool((tokens[1:] >= tokens[:-1]).all()), tokens.tolist()
        mixed |= int(tokens.max()) > start
    return mixed


class GateMailbox(ThreadMailbox):
    """Makes the producer's engine wait, in the middle of a generation for batch k, for the
    learner's next version whenever that version can come without this batch (the generation
    started with version ≤ k − 2): a switch mid-generation then happens at every such step,
    whatever the threads' speeds."""

    def __init__(self) -> None:
        super().__init__()
        self.step, self.calls, self.start = 0, 0, 0
        self.posted = threading.Condition()

    def post(self, version, weights):
        with self.posted:
            super().post(version, weights)
            self.posted.notify_all()

    def take_newer(self, version, model):
        self.calls += 1
        if self.calls == 1:
            self.start = version
        if self.calls == 4 and self.start <= self.step - 2:
            with self.posted:
                assert self.posted.wait_for(lambda: self.latest is not None and self.latest[0] > version, timeout=60)
        return super().take_newer(version, model)


def gate(producer: AsyncProducer) -> GateMailbox:
    engine, source, mailbox = producer.engine, producer.inner, GateMailbox()
    engine.mailbox = mailbox
    generate, next_batch = engine.generate, source.next_batch

    def counted_generate(*args, **kwargs):
        mailbox.calls = 0
        return generate(*args, **kwargs)

    def stepped_next_batch(step):
        mailbox.step = step
        return next_batch(step)

    engine.generate, source.next_batch = counted_generate, stepped_next_batch
    return mailbox


def test_a_batch_in_flight_switches_to_the_learners_new_weights(tmp_path):
    # the decoupled loss with AReaL's log-linear proximal reads the per-token versions
    overrides = ["algorithm=areal", "algorithm.proximal=loglinear", "steps=6", "max_new_tokens=10",
                 "record_rollouts=true", "rollout.max_staleness=2", "rollout.interrupt=true",
                 "rollout.producer=thread"]  # fmt: skip
    run = make_run(tmp_path, overrides, "gated")
    gate(run.source.inner)
    history = run.run()
    mixed_steps = []
    for step in range(1, 7):
        batch, _ = read_batch(tmp_path / "gated" / "rollouts", step)
        if check_contained(batch, step, eta=2):
            mixed_steps.append(step)
        assert history[step - 1]["async/staleness_max"] <= 2
    assert mixed_steps, "no batch switched weights mid-generation"
    assert any(history[step - 1]["async/interrupted_fraction"] > 0 for step in mixed_steps)
    assert all(math.isfinite(h["loss/policy"]) for h in history) and history[-1]["policy/grad_norm"] > 0


def test_the_rollout_process_switches_and_the_bound_holds(tmp_path):
    overrides = [*NO_KL, "steps=6", "max_new_tokens=12", "sampling.stop=[a]", "record_rollouts=true",
                 "rollout.max_staleness=2", "rollout.interrupt=true"]  # fmt: skip
    run = make_run(tmp_path, overrides, "process")
    assert run.source.inner.engine.mailbox is not None  # a shared mailbox for the child
    history = run.run()
    for step in range(1, 7):
        batch, _ = read_batch(tmp_path / "process" / "rollouts", step)
        check_contained(batch, step, eta=2)
        assert "async/versions_per_sample" in history[step - 1]
    assert history[-1]["policy/grad_norm"] > 0


def slow_vowel_share(prompts, completions, completion_ids, **columns):
    """vowel_share, slowed so that the producer is the bottleneck: the learner trains each batch
    as soon as it is made, so newer versions than the admitted one are held when a batch starts."""
    time.sleep(0.3)
    return vowel_share(prompts, completions, completion_ids)


slow_vowel_share.__name__ = "vowel_share"


def test_a_producer_behind_the_learner_starts_each_batch_with_the_newest_weights(tmp_path):
    # regression: with η ≥ 2 a batch that started with the newest version dropped the older ones,
    # and the next batch then waited forever for its admitted version
    overrides = [*NO_KL, "steps=7", "max_new_tokens=6", "record_rollouts=true", "rollout.max_staleness=3",
                 "rollout.interrupt=true", "rollout.producer=thread"]  # fmt: skip
    run = make_run(tmp_path, overrides, "behind", rewards=(slow_vowel_share,))
    finished: list = []
    worker = threading.Thread(target=lambda: finished.append(run.run()), daemon=True)
    worker.start()
    worker.join(timeout=120)
    if worker.is_alive():
        run.source.inner.close()
        pytest.fail("the run stopped making progress (a batch waited for weights that were dropped)")
    assert [h["step"] for h in finished[0]] == list(range(1, 8))
    for step in range(1, 8):
        batch, _ = read_batch(tmp_path / "behind" / "rollouts", step)
        check_contained(batch, step, eta=3)


def test_environment_episodes_record_a_version_per_token(tmp_path):
    from tests.sources.test_environment import RUN

    config = load_rl_config(None, [*RUN, "algorithm=grpo", "steps=4", "rollout.max_staleness=1",
                                   "rollout.interrupt=true", "rollout.producer=thread", "record_rollouts=true",
                                   f"output_dir={tmp_path / 'env'}"])  # fmt: skip
    run = OnlineRL(config, echo=lambda line: None)
    gate(run.source.inner)
    history = run.run()
    mixed = []
    for step in range(1, 5):
        batch, _ = read_batch(tmp_path / "env" / "rollouts", step)
        assert batch.token_versions.shape == batch.response_ids.shape
        mixed.append(check_contained(batch, step, eta=1))
    assert any(mixed), "no episode switched weights mid-play"
    assert all(h["env/errors"] == 0 for h in history)


def test_a_resume_repeats_the_steps_the_checkpoint_recorded(tmp_path):
    overrides = [*NO_KL, "steps=6", "max_new_tokens=8", "save_every=1", "keep_last=6",
                 "rollout.max_staleness=2", "rollout.interrupt=true"]  # fmt: skip
    straight = make_run(tmp_path, overrides, "straight").run()
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed_dir)
    shutil.rmtree(resumed_dir / "final")
    for path in checkpoint_root(resumed_dir).iterdir():
        if int(path.name.split("-")[1]) > 2:
            shutil.rmtree(path)
    config = load_rl_config(None, [*TINY, *SMALL, *overrides, f"output_dir={resumed_dir}", "resume=auto"])
    resumed = OnlineRL(config, reward_functions=list(make_run.__defaults__[0]), echo=lambda line: None).run()
    assert [h["step"] for h in resumed] == [3, 4, 5, 6]
    # batches 3-5 were made before the checkpoint's next update, and recorded with it
    assert deterministic(resumed[:3]) == deterministic(straight[2:5])


def test_token_version_metrics():
    versions = torch.tensor([[2, 2, 3, 3], [3, 3, 3, 0], [1, 2, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    metrics = token_version_metrics(versions, mask, learner_version=3)
    assert metrics["async/versions_per_sample"] == pytest.approx((2 + 1 + 3) / 3)
    assert metrics["async/interrupted_fraction"] == pytest.approx(2 / 3)
    assert metrics["async/token_staleness_mean"] == pytest.approx((1 + 1 + 0 + 0 + 0 + 2 + 1 + 0 + 0) / 9)


def test_interrupt_needs_an_asynchronous_run():
    with pytest.raises(ConfigError, match=r"rollout\.interrupt.*max_staleness >= 1"):
        load_rl_config(None, [*TINY, *SMALL, "rollout.interrupt=true"])
