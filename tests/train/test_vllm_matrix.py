"""The combination matrix's pairs with vLLM (issue 42), run by ``make test-vllm`` in .venv-vllm:
``rollout.engine: vllm`` with every other feature of ``matrix_features.py`` runs two steps and both
take effect — the batches sampled by a vLLM instance (colocated, the producer thread's, each Ray
worker's, or each torchrun rank's over its whole copy of an FSDP2 policy). With
``rollout.interrupt`` the producer's vLLM is interrupted between two steps (rollout/vllm_interrupt.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment (bash scripts/install_vllm_cpu.sh builds .venv-vllm, "
        "where these tests run)",
        allow_module_level=True,
    )

from .matrix_features import FEATURES
from .matrix_pairs import run_pair
from .test_combination_matrix import ray_address  # noqa: F401 (a fixture: one local cluster for the module)

pytestmark = pytest.mark.slow

HERE = [name for name in FEATURES if name != "fsdp2"]  # fsdp2 runs on two torchrun ranks


@pytest.mark.parametrize("other", HERE)
def test_vllm_with_every_feature_runs_and_both_take_effect(request, tmp_path, other):
    address = request.getfixturevalue("ray_address") if other == "ray" else None
    run_pair(("vllm", other), tmp_path, address)


def test_vllm_with_fsdp2_runs_on_two_ranks_each_sampling_with_its_own_vllm(tmp_path):
    """Each rank's vLLM samples from the whole copy of the sharded policy (rollout/gathered.py),
    given the gathered weights after every update: the pair runs on two gloo ranks and both
    features take effect on each (a vLLM in a torchrun rank joins the launch's process group)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    results = tmp_path / "results.jsonl"
    command = [*launcher, "-m", "tests.train.matrix_pairs", str(results), str(tmp_path), "-", "vllm×fsdp2"]
    launch = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert results.is_file(), f"the launch stopped before the pair:\n{launch.stderr[-4000:]}"
    (result,) = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines()]
    assert result == {"pair": "vllm×fsdp2", "failures": []}, "\n".join(result["failures"])
