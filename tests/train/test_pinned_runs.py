"""Behaviour pinned across refactors of the RL loop (issue 18): short runs of the shipped reverse
config under five algorithms, their every logged metric and a checksum of the final weights,
recorded before the loop was split into rollout source / batch preparation / update. A change
that moves any number by one ulp fails here.

The records hold the torch version they were made with; floating-point results differ between
torch builds, so on another version the comparison is skipped with that reason. To record anew
(only when a change is *meant* to alter the numbers, said in its commit):
``POSTTRAIN_REPIN=1 pytest tests/train/test_pinned_runs.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
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
    return {"torch": torch.__version__, "overrides": overrides, "metrics": metrics, "weights": weights}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_pinned_run_repeats_its_recorded_numbers(tmp_path, name):
    path = PINNED / f"{name}.json"
    got = record(tmp_path, name)
    if os.environ.get("POSTTRAIN_REPIN") == "1":
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"recorded {path}")
    pinned = json.loads(path.read_text())
    if pinned["torch"] != torch.__version__:
        pytest.skip(f"pinned with torch {pinned['torch']}, this is {torch.__version__}")
    assert len(got["metrics"]) == len(pinned["metrics"])
    for new, old in zip(got["metrics"], pinned["metrics"], strict=True):
        assert new == old, f"step {old.get('step')}: " + ", ".join(
            f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)
        )
    assert got["weights"] == pinned["weights"]
