"""The combination matrix's pairs with vLLM (issue 42), run by ``make test-vllm`` in .venv-vllm:
``rollout.engine: vllm`` with every other feature of ``matrix_features.py`` runs two steps and both
take effect — the batches sampled by a vLLM instance (colocated, the producer thread's, or each Ray
worker's) — except ``strategy: fsdp2``, not built yet, refused before loading with why. With
``rollout.interrupt`` the producer's vLLM is interrupted between two steps (rollout/vllm_interrupt.py)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment (bash scripts/install_vllm_cpu.sh builds .venv-vllm, "
        "where these tests run)",
        allow_module_level=True,
    )

from posttrain.config import ConfigError
from posttrain.train.rl_config import load_rl_config

from .matrix_features import FEATURES, STEPS, Feature, Trace, base_overrides, write_rows
from .matrix_pairs import run_pair
from .test_combination_matrix import ray_address  # noqa: F401 (a fixture: one local cluster for the module)

pytestmark = pytest.mark.slow

NOT_YET = {
    "fsdp2": "strategy = 'fsdp2' with rollout.engine = 'vllm' is not supported yet",
}


def _vllm(trace: Trace) -> None:
    if trace.run.config.cluster.kind == "ray":  # each worker's engine: built there from the config's kind
        assert trace.ray_generations >= STEPS and trace.run.config.engine_kind == "vllm"
    else:
        assert trace.vllm_generations >= STEPS  # every batch drawn by a VLLMEngine of this process


# head dim 32 (64 / 2): vLLM's CPU attention takes head sizes from 32 up; the producer in a thread,
# whose engine this process can watch (the rollout process's vLLM is tested in test_rl_vllm.py)
VLLM = Feature(["rollout.engine=vllm", "model.tiny.hidden=64", "rollout.vllm.max_model_len=64",
                "rollout.producer=thread"], _vllm)  # fmt: skip
OTHERS = [name for name in FEATURES if name not in NOT_YET]


@pytest.mark.parametrize("other", OTHERS)
def test_vllm_with_every_feature_runs_and_both_take_effect(request, tmp_path, monkeypatch, other):
    monkeypatch.setitem(FEATURES, "vllm", VLLM)
    address = request.getfixturevalue("ray_address") if other == "ray" else None
    run_pair(("vllm", other), tmp_path, address)


@pytest.mark.parametrize("other", sorted(NOT_YET))
def test_vllm_with_fsdp2_is_refused_before_loading_saying_why(tmp_path, other):
    data = write_rows(tmp_path / "rows.jsonl")
    overrides = [*base_overrides(data, tmp_path / "run"), *VLLM.overrides, *FEATURES[other].overrides]
    with pytest.raises(ConfigError, match=NOT_YET[other]):
        load_rl_config(None, overrides)
    assert not (tmp_path / "run").exists()
