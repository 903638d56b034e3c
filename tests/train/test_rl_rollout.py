"""The RL config's rollout section and what it switches on without vLLM: the engine choice, the
engine/trainer mismatch metrics, truncated importance sampling, and vLLM's install hint."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.config import ConfigError
from posttrain.train.rl_config import load_rl_config
from tests.train.test_rl import SMALL, TINY, make_run


def test_rollout_engine_vllm_and_its_options_validate():
    config = load_rl_config(None, [*TINY, *SMALL, "rollout.engine=vllm", "rollout.vllm.dtype=bfloat16"])
    assert config.engine_kind == "vllm" and config.rollout.vllm.dtype == "bfloat16"
    assert load_rl_config(None, [*TINY, *SMALL, "engine=native"]).engine_kind == "native"  # the shortcut
    assert load_rl_config(None, [*TINY, *SMALL]).engine_kind == "auto"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["engine=native", "rollout.engine=vllm"], ["engine", "rollout.engine"]),
        (["algorithm=gspo", "rollout.tis_cap=2"], ["rollout.tis_cap", "algorithm.policy_loss"]),
        (["rollout.vllm.gpu_memory_fraction=0.5"], ["gpu_memory_fraction"]),
        (["rollout.engine=sglang"], ["rollout.engine"]),
    ],
)
def test_bad_rollout_settings_are_refused_naming_the_fields(overrides, names):
    with pytest.raises(ConfigError) as error:
        load_rl_config(None, [*TINY, *SMALL, *overrides])
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize("updates", [[], ["ppo_epochs=2"]], ids=["on-policy", "two-epochs"])
def test_tis_with_the_native_engine_measures_no_mismatch_and_weights_of_one(tmp_path, updates):
    # on-policy the update's own forward is compared; with two epochs, the recomputed π_old
    run = make_run(tmp_path, ["steps=2", "rollout.tis_cap=2", *updates])
    history = run.run()
    for metrics in history:
        # the native engine computes the trainer's own forward: the two streams agree
        assert metrics["rollout/mismatch_kl"] < 1e-8 and metrics["rollout/logprob_diff_max"] < 1e-4
        assert metrics["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["rollout/tis_capped_fraction"] == 0.0
        assert "time/weight_sync_s" in metrics


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_says_how_to_install_it(tmp_path):
    with pytest.raises(ImportError, match=r"install_vllm_cpu\.sh"):
        make_run(tmp_path, ["rollout.engine=vllm"])
