"""Behaviour pinned across refactors of the RL loop (issue 18): short runs of the shipped reverse
config under five algorithms, their every logged metric and a checksum of the final weights,
recorded before the loop was split into rollout source / batch preparation / update.

The records hold what the numbers depend on besides posttrain's code: the torch and transformers
versions, the CPU instructions torch's kernels use, and the CPU itself (vendor, model and a hash
of its feature flags: MKL and NumPy pick their kernels by these, so an Intel and an AMD AVX512
machine disagree in a step-1 log-prob gap's last bits). On the recording platform a change that
moves any number by one ulp fails. On another CPU the numbers are compared within CROSS_CPU (the
drift measured between an Intel Xeon and an AMD EPYC over these runs, with a margin), which a
change of what the loop computes still exceeds by orders of magnitude. The same tolerance holds
across transformers releases (a fresh install takes the newest in range, so skipping there would
leave the runs unchecked from the day one comes out); where torch or the kernels' instructions
differ the comparison is skipped with that reason. To record anew
(when a change is *meant* to alter the numbers, said in its commit, or for a new machine,
recorded from the commit before any change): ``POSTTRAIN_REPIN=1 pytest tests/train/test_pinned_runs.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform as _platform
import re
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
# Intel Xeon vs AMD EPYC, same torch build (2.11.0 and 2.13.0): weight sums within 5.3e-5 relative,
# metrics within 1e-6 absolute where they are differences of near-equal numbers (log-prob gaps,
# advantage means ~1e-8) and 1e-4 relative elsewhere, after 20 steps of Adam at lr 1e-2 (which
# turns last-bit gradient differences into full-size steps). The same holds across a transformers
# release: pinned on an EPYC with 5.24.0, run on a Xeon with 5.25.0, weight sums within 6.4e-5 and
# metrics within 3.4e-5 relative (2026-12-06).
CROSS_CPU = {"rel_tol": 1e-3, "abs_tol": 1e-5}


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
        "cpu": cpu_identity(),
    }


def cpu_identity() -> str:
    """Vendor, model name and a hash of the feature flags: what BLAS and NumPy dispatch on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{_platform.machine()} {_platform.processor()}"
    fields = dict(re.findall(r"^(vendor_id|model name|flags)\s*:\s*(.*)$", text, flags=re.MULTILINE))
    flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:12]
    return f"{fields.get('vendor_id', '?')} {fields.get('model name', '?')} flags {flags}"


def assert_close(new: dict, old: dict, where: str) -> None:
    """Every number within CROSS_CPU; everything else (strings, counts of keys) equal."""
    assert new.keys() == old.keys(), f"{where}: keys {sorted(set(new) ^ set(old))}"
    for key, value in old.items():
        if isinstance(value, float) and isinstance(new[key], (int, float)):
            assert math.isclose(new[key], value, **CROSS_CPU), f"{where}, {key}: {value} -> {new[key]}"
        else:
            assert new[key] == value, f"{where}, {key}: {value} -> {new[key]}"


def comparison(pinned: dict, here: dict) -> str:
    """How a run here is held to its record: ``"exact"`` on the recording platform, ``"close"``
    (within CROSS_CPU) where only the CPU or the transformers release differs, else why there is no
    comparison (another torch, or kernels built for other instructions)."""
    differing = {key: (pinned.get(key), value) for key, value in here.items() if pinned.get(key) != value}
    if set(differing) - {"cpu", "transformers"}:
        return "pinned on another platform: " + ", ".join(f"{k} {a} here {b}" for k, (a, b) in differing.items())
    return "close" if differing else "exact"


def test_only_another_torch_or_instruction_set_leaves_a_pinned_run_unchecked():
    """A fresh install takes the newest transformers in range: were its release a reason to skip,
    the pinned runs would stop checking anything the day it comes out (they did: 5.24 -> 5.25)."""
    pinned = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "cpu_capability": "AVX512", "cpu": "AMD"}
    assert comparison(pinned, dict(pinned)) == "exact"
    assert comparison(pinned, {**pinned, "cpu": "Intel"}) == "close"
    assert comparison(pinned, {**pinned, "transformers": "5.25.0", "cpu": "Intel"}) == "close"
    assert comparison(pinned, {**pinned, "torch": "2.14.0+cpu"}).startswith("pinned on another platform: torch")
    assert comparison(pinned, {**pinned, "cpu_capability": "AVX2"}).startswith("pinned on another platform")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_pinned_run_repeats_its_recorded_numbers(tmp_path, name):
    path = PINNED / f"{name}.json"
    got = record(tmp_path, name)
    if os.environ.get("POSTTRAIN_REPIN") == "1":
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"recorded {path}")
    pinned = json.loads(path.read_text())
    here = platform()
    how = comparison(pinned, here)
    if how not in ("exact", "close"):
        pytest.skip(how)
    assert len(got["metrics"]) == len(pinned["metrics"])
    if how == "close":  # the drift of another CPU or transformers release stays far below a change's
        where = f"pinned on {pinned.get('cpu')}, transformers {pinned.get('transformers')}"
        where += f"; here {here['cpu']}, {here['transformers']}"
        for new, old in zip(got["metrics"], pinned["metrics"], strict=True):
            assert_close(new, old, f"step {old.get('step')} ({where})")
        assert_close(got["weights"], pinned["weights"], f"final weight sums ({where})")
        return
    for new, old in zip(got["metrics"], pinned["metrics"], strict=True):
        assert new == old, f"step {old.get('step')}: " + ", ".join(
            f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)
        )
    assert got["weights"] == pinned["weights"]
