"""Behaviour pinned across refactors of the RL loop (issue 18): short runs of the shipped reverse
config under five algorithms, their every logged metric and a checksum of the final weights,
recorded before the loop was split into rollout source / batch preparation / update. A change
that moves any number by one ulp fails here.

The records hold what they were made with — the torch and transformers versions and the CPU
instructions torch's kernels use (AVX2, AVX512: the same build rounds differently on each, the
last digits of a step-1 log-prob gap already) — and where any of them differs the comparison is
skipped with that reason. To record anew (when a change is *meant* to alter the numbers, said in
its commit, or for a new machine, recorded from the commit before any change):
``POSTTRAIN_REPIN=1 pytest tests/train/test_pinned_runs.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.rl import run_rl
from posttrain.train.rl_config import load_rl_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PINNED = Path(__file__).parent / "pinned"
TINY = ["model.path=null", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
SMALL = [
    "data.n_train=200", "data.n_eval=9", "prompts_per_step=4", "samples_per_prompt=4", "max_new_tokens=8",
    "learning_rate=1e-2", "eval_every=5", "eval_size=9", "save_every=0", "log_every=1000", "log_samples=0",
    "rewards=[tests.train.test_rl:vowel_share]", "threads=2",  # reductions split the same way on any machine
]  # fmt: skip
RUNS = {
    "grpo": (20, []),
    "ppo": (20, ["algorithm=ppo", "algorithm.kl.coef=0.05"]),
    "dapo": (10, ["algorithm=dapo", "algorithm.overlong.cache_length=3"]),
    "remax": (10, ["algorithm=remax"]),
    "gdpo": (10, ["algorithm=gdpo", "rewards=[tests.train.test_rl:vowel_share, tests.train.test_rl:has_dot]"]),
}
UNSTABLE = ("time/", "throughput/")  # wall-clock figures


def record(tmp_path: Path, name: str) -> dict:
    steps, extra = RUNS[name]
    out = tmp_path / name
    overrides = [*TINY, *SMALL, f"steps={steps}", *extra]
    config = load_rl_config(str(REPO / "configs" / "reverse_grpo.yaml"), [*overrides, f"output_dir={out}"])
    threads = torch.get_num_threads()
    try:
        run_rl(config, echo=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    rows = read_jsonl(out / "metrics.jsonl")
    metrics = [{k: v for k, v in row.items() if not k.startswith(UNSTABLE)} for row in rows]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    weights = {k: float(v.double().sum()) for k, v in model.state_dict().items()}
    return {**platform(), "overrides": overrides, "metrics": metrics, "weights": weights}


def platform() -> dict[str, str]:
    """What the numbers depend on besides posttrain's code."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_pinned_run_repeats_its_recorded_numbers(tmp_path, name):
    path = PINNED / f"{name}.json"
    got = record(tmp_path, name)
    if os.environ.get("POSTTRAIN_REPIN") == "1":
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"recorded {path}")
    pinned = json.loads(path.read_text())
    differing = {key: (pinned.get(key), value) for key, value in platform().items() if pinned.get(key) != value}
    if differing:
        pytest.skip("pinned on another platform: " + ", ".join(f"{k} {a} here {b}" for k, (a, b) in differing.items()))
    assert len(got["metrics"]) == len(pinned["metrics"])
    for new, old in zip(got["metrics"], pinned["metrics"], strict=True):
        assert new == old, f"step {old.get('step')}: " + ", ".join(
            f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)
        )
    assert got["weights"] == pinned["weights"]
