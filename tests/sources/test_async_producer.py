"""The asynchronous producer (``rollout.max_staleness``, sources/async_producer.py): no sample is
trained on more than η versions after the weights that sampled it, the batches do not depend on
how the producer and learner threads interleave, a frozen policy gives the synchronous run's
batches, and a failed batch stops the run at its own step with the earlier steps saved.
(Exact resume with η ≥ 1 is in tests/train/test_resume.py.)"""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.sources.async_producer import AsyncProducer, staleness_metrics
from posttrain.sources.recorded import read_batch, recorded_steps
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
SMALL = ["data.task=reverse", "data.n_train=64", "data.n_eval=9", "eval_size=0", "prompts_per_step=4"]
SMALL += ["samples_per_prompt=4", "learning_rate=1e-2", "log_every=100", "reward_workers=0", "seed=3"]
NO_KL = ["algorithm=grpo", "algorithm.kl.placement=none", "algorithm.kl.coef=0"]


def vowel_share(prompts, completions, completion_ids, **columns):
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def slow_vowel_share(prompts, completions, completion_ids, **columns):
    """vowel_share, slowed unevenly: the producer falls behind the learner at some steps only."""
    slow_vowel_share.calls += 1
    time.sleep(0.6 if slow_vowel_share.calls in (3, 5) else 0.0)
    return vowel_share(prompts, completions, completion_ids)


slow_vowel_share.__name__ = "vowel_share"  # logged under the same name as the fast one


def prompt_length(prompts, completions, completion_ids, **columns):
    """Equal within each group (no advantage, no gradient: the weights never move) but varying
    between prompts, so the logged reward shows which prompts were drawn."""
    return [len(prompt) % 5 / 4 for prompt in prompts]


def make_run(tmp_path, overrides, name, rewards=(vowel_share,)):
    config = load_rl_config(None, [*TINY, *SMALL, f"output_dir={tmp_path / name}", *overrides])
    return OnlineRL(config, reward_functions=list(rewards), echo=lambda line: None)


def deterministic(history):
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in history]


def test_no_sample_is_trained_more_than_eta_versions_after_its_weights(tmp_path):
    # responses of uneven length (a stop may come anywhere in 12 tokens), recorded as consumed
    run = make_run(tmp_path, [*NO_KL, "steps=7", "max_new_tokens=12", "sampling.stop=[a]", "record_rollouts=true",
                              "rollout.max_staleness=2"], "eta2")  # fmt: skip
    assert isinstance(run.source.inner, AsyncProducer)  # under the recording wrapper
    history = run.run()
    lengths = set()
    for step in range(1, 8):
        batch, _ = read_batch(tmp_path / "eta2" / "rollouts", step)
        lengths.update(batch.response_mask.sum(-1).long().tolist())
        # batch k samples with version max(0, k − 1 − η): the bound, and reached once it can be
        assert batch.policy_version.tolist() == [max(0, step - 3)] * len(batch)
        assert history[step - 1]["async/staleness_max"] == min(step - 1, 2)
        assert history[step - 1]["async/staleness_max"] <= 2
    assert len(lengths) > 3, lengths  # the lengths really were uneven
    assert history[-1]["async/staleness_2"] == 1.0 and history[0]["async/staleness_0"] == 1.0
    assert (tmp_path / "eta2" / "report_async_staleness_histogram.png").is_file()


def test_the_batches_do_not_depend_on_how_the_threads_interleave(tmp_path):
    common = [*NO_KL, "steps=6", "max_new_tokens=8", "rollout.max_staleness=2"]
    fast = make_run(tmp_path, common, "fast").run()
    slow_vowel_share.calls = 0
    slow = make_run(tmp_path, common, "slow", rewards=(slow_vowel_share,)).run()
    assert deterministic(fast) == deterministic(slow)
    # the producer decoding in a thread of this process instead of the rollout process: the same batches
    in_thread = make_run(tmp_path, [*common, "rollout.producer=thread"], "thread").run()
    assert deterministic(fast) == deterministic(in_thread)
    assert max(h["time/learner_wait_s"] for h in slow) > 0.2  # the learner did wait for the slow producer
    # the weights moved: a run that learns nothing would pass trivially
    assert fast[-1]["policy/grad_norm"] > 0


def test_a_frozen_policy_gives_the_synchronous_runs_batches(tmp_path):
    # every advantage is 0 and nothing else trains (no KL, entropy or weight decay): each version's
    # weights are the first ones, so the producer must draw exactly the synchronous batches
    common = [*NO_KL, "steps=5", "max_new_tokens=8", "weight_decay=0", "preflight=false",
              "record_rollouts=true"]  # fmt: skip
    synchronous = make_run(tmp_path, common, "sync", rewards=(prompt_length,)).run()
    # the producer's child process decodes with this process's threads: a matmul split over other
    # thread counts rounds differently, and the log-probs are compared bit for bit
    same_threads = f"rollout.producer_threads={torch.get_num_threads()}"
    asynchronous = make_run(tmp_path, [*common, "rollout.max_staleness=3", same_threads], "async",
                            rewards=(prompt_length,)).run()  # fmt: skip
    for step in range(1, 6):
        a, _ = read_batch(tmp_path / "sync" / "rollouts", step)
        b, _ = read_batch(tmp_path / "async" / "rollouts", step)
        assert a.prompts == b.prompts and torch.equal(a.response_ids, b.response_ids), step
        assert torch.equal(a.engine_logprobs, b.engine_logprobs), step
    keys = ("reward/mean", "reward/std", "response/length_mean")
    assert [[h[k] for k in keys] for h in synchronous] == [[h[k] for k in keys] for h in asynchronous]
    assert len({h["reward/mean"] for h in synchronous}) > 1  # the prompts drawn differ step to step


def test_eta_0_is_the_synchronous_loop(tmp_path):
    default = make_run(tmp_path, [*NO_KL, "steps=3"], "default")
    explicit = make_run(tmp_path, [*NO_KL, "steps=3", "rollout.max_staleness=0"], "explicit")
    assert not isinstance(explicit.source, AsyncProducer) and explicit.engine.model is explicit.policy
    first, second = default.run(), explicit.run()
    assert deterministic(first) == deterministic(second)
    assert not any(key.startswith("async/") for key in second[-1])
    assert not (tmp_path / "explicit" / "report_async_staleness_histogram.png").exists()


def failing_at_step_3(prompts, completions, completion_ids, **columns):
    failing_at_step_3.calls += 1
    if failing_at_step_3.calls == 3:
        raise KeyError("answer")
    return vowel_share(prompts, completions, completion_ids)


def test_a_failed_batch_stops_the_run_at_its_own_step_after_saving_the_earlier_ones(tmp_path):
    failing_at_step_3.calls = 0
    run = make_run(tmp_path, [*NO_KL, "steps=6", "save_every=1", "rollout.max_staleness=2"], "broken",
                   rewards=(failing_at_step_3,))  # fmt: skip
    with pytest.raises(Exception, match="'failing_at_step_3' raised KeyError"):
        run.run()
    logged = [record["step"] for record in read_jsonl(tmp_path / "broken" / "metrics.jsonl")]
    assert logged == [1, 2]
    saved = sorted(path.name for path in (tmp_path / "broken" / "checkpoints").iterdir())
    assert saved == ["step-1", "step-2"]
    # the run records by default: the batches handed out, not the failed one made ahead
    assert recorded_steps(tmp_path / "broken" / "rollouts") == [1, 2]
    producer = run.source.inner  # under the recording
    assert producer.thread is not None and not producer.thread.is_alive()  # closed, not left running


def test_staleness_metrics_are_a_histogram_of_the_batchs_versions():
    metrics = staleness_metrics(torch.tensor([4, 4, 3, 0]), learner_version=5)
    assert metrics["async/staleness_mean"] == pytest.approx((1 + 1 + 2 + 5) / 4)
    assert metrics["async/staleness_max"] == 5
    assert [metrics[f"async/staleness_{k}"] for k in range(5)] == [0.0, 0.5, 0.25, 0.0, 0.25]


def test_environment_episodes_are_produced_ahead_and_evaluated_with_the_trained_policy(tmp_path):
    from tests.sources.test_environment import RUN

    config = load_rl_config(None, [*RUN, "algorithm=grpo", "steps=4", "eval_every=2", "rollout.max_staleness=1",
                                   f"output_dir={tmp_path / 'run'}"])  # fmt: skip
    run = OnlineRL(config, echo=lambda line: None)
    # the producer plays episodes on its own copy; held-out episodes are played by the policy itself
    assert run.source.inner.engine.model is not run.policy and run.evaluation.engine.model is run.policy
    history = run.run()
    assert [h["async/staleness_max"] for h in history] == [0, 1, 1, 1]
    assert all(h["env/errors"] == 0 for h in history) and "eval/resolved" in history[1]


def test_the_rollout_process_returns_the_engines_samples_and_reports_its_errors_and_death():
    import os
    import signal

    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer
    from posttrain.rollout.engine import build_engine
    from posttrain.rollout.process_engine import ProcessEngine, RolloutProcessError
    from posttrain.rollout.types import SamplingParams

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    local = build_engine(model, tokenizer)
    remote = ProcessEngine(copy.deepcopy(model), tokenizer, threads=1)
    prompts, sampling = [[5, 6, 7], [8, 9]], SamplingParams(n=3, max_new_tokens=5, seed=11)
    # bit-identical log-probs need the same kernels on both sides: a matmul split over 2 threads
    # rounds differently from one over 1, so this process decodes with the child's one thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mine, theirs = local.generate(prompts, sampling), remote.generate(prompts, sampling)
        assert torch.equal(mine.response_ids, theirs.response_ids) and torch.equal(mine.logprobs, theirs.logprobs)
        # new weights are written into the shared copy here and picked up there
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
        remote.update_weights(1, model.state_dict())
        local.update_weights(1)
        mine, theirs = local.generate(prompts, sampling), remote.generate(prompts, sampling)
        assert torch.equal(mine.logprobs, theirs.logprobs) and bool((theirs.policy_version == 1).all())
        with pytest.raises(ValueError, match="every prompt at least one token"):
            remote.generate([[]], sampling)  # raised in the child, handed back as itself
        os.kill(remote.process.pid, signal.SIGKILL)
        with pytest.raises(RolloutProcessError, match="died"):
            remote.generate(prompts, sampling)
    finally:
        torch.set_num_threads(threads)
        remote.close()


def test_loglinear_proximal_interpolates_by_each_samples_version_gap():
    from posttrain.algos import loglinear_proximal_logprobs

    behaviour = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    current = torch.tensor([[-0.5, -1.0], [-0.5, -1.0], [-0.5, -1.0]])
    # proximal version 4; samples from versions 4 (fresh), 3 and 1: alpha 0, 1/2, 3/4
    proximal = loglinear_proximal_logprobs(behaviour, current, torch.tensor([4, 3, 1]), proximal_version=4)
    assert torch.allclose(proximal[0], behaviour[0])
    assert torch.allclose(proximal[1], torch.tensor([-0.75, -1.5]))
    assert torch.allclose(proximal[2], torch.tensor([-0.625, -1.25]))


def test_areal_with_the_loglinear_proximal_skips_the_step_start_forward_and_trains(tmp_path):
    overrides = ["algorithm=areal", "algorithm.proximal=loglinear", "ppo_epochs=2", "minibatch_size=8", "steps=3",
                 "rollout.max_staleness=1", "max_new_tokens=6"]  # fmt: skip
    run = make_run(tmp_path, overrides, "loglinear")
    assert not run.preparer.recompute_old_logprobs  # the forward pass the approximation replaces
    history = run.run()
    assert all(math.isfinite(h["loss/policy"]) and h["policy/grad_norm"] > 0 for h in history)
    # a loss without a proximal policy has nothing to approximate
    with pytest.raises(ConfigError, match=r"algorithm\.proximal = .loglinear."):
        load_rl_config(None, [*TINY, *SMALL, "algorithm=grpo", "algorithm.proximal=loglinear"])
