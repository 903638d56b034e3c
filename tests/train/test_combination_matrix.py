"""The combination matrix (issue 42): every pair of RL features runs two steps and each feature
takes effect (``matrix_features.py`` says what that means for each), or the pair is refused before
anything loads — and only the pairs that cannot mean anything are refused, each message saying why
(``matrix_pairs.REFUSED``). A replayed pair replays a recording of the same pair: the replay repeats
its losses.

The pairs with fsdp2 run on two gloo ranks, all of them in one torchrun launch (``matrix_pairs.py``);
the pairs with Ray share one local cluster, which the fsdp2 ranks join too."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from .matrix_features import FEATURES
from .matrix_pairs import run_pair

pytestmark = pytest.mark.slow

PAIRS = list(itertools.combinations(FEATURES, 2))
HERE = [pair for pair in PAIRS if "fsdp2" not in pair]
RANKED = [pair for pair in PAIRS if "fsdp2" in pair]


def name(pair: tuple[str, str]) -> str:
    return "×".join(pair)


@pytest.fixture(scope="module")
def ray_address():
    """The address of a local Ray cluster for the module's Ray pairs (this process is its driver)."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'posttrain[dist]'")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def ranked(request, tmp_path_factory):
    """Every fsdp2 pair run on two torchrun ranks, in one launch: {pair: failed checks}, and the
    launch's output (for a pair it never reached)."""
    work = tmp_path_factory.mktemp("ranked")
    pairs = [pair for pair in RANKED if "ray" not in pair]
    try:
        address = request.getfixturevalue("ray_address")
        pairs = RANKED
    except pytest.skip.Exception:
        address = "-"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*launcher, "-m", "tests.train.matrix_pairs", str(work / "results.jsonl"), str(work), address]
    launch = subprocess.run(
        [*command, *map(name, pairs)], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    results = work / "results.jsonl"
    lines = results.read_text(encoding="utf-8").splitlines() if results.is_file() else []
    return {(r := json.loads(line))["pair"]: r["failures"] for line in lines}, launch


@pytest.mark.parametrize("pair", HERE, ids=map(name, HERE))
def test_every_pair_runs_and_each_feature_takes_effect(request, tmp_path, pair):
    address = request.getfixturevalue("ray_address") if "ray" in pair else None
    run_pair(pair, tmp_path, address)


@pytest.mark.parametrize("pair", RANKED, ids=map(name, RANKED))
def test_every_pair_with_fsdp2_runs_on_two_ranks(ranked, pair):
    results, launch = ranked
    if "ray" in pair and name(pair) not in results and launch.returncode == 0:
        pytest.skip("Ray is an optional extra: pip install 'posttrain[dist]'")
    assert name(pair) in results, f"the launch stopped before this pair:\n{launch.stderr[-4000:]}"
    assert results[name(pair)] == [], "\n".join(results[name(pair)])
