"""A run killed with SIGKILL resumes exactly (issue 23, acceptance): ``posttrain rl`` with LoRA
and steps that train no sample is killed at 20 random instants (while it starts, samples,
updates, writes a checkpoint, deletes an old one, saves the final model or writes its report),
each time continued with ``--resume auto``; every chain of resumes ends on the straight run's
metrics and adapter weights, bit for bit.

Each kill is a real ``kill -9`` of a separate ``python -m posttrain`` process: nothing in memory
survives it, and whatever it was writing is left half-written."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.telemetry.metrics import read_jsonl

from .resume_cases import overrides, rows_with_dead_steps, write_rows

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 24
DEAD = {3, 4, 9, 15, 16}  # steps whose rows all score 0: they train no sample
KILLS = 20
LORA_GRPO = [
    "algorithm=grpo", "algorithm.kl.placement=none", "algorithm.kl.coef=0",
    "model.lora.r=4", "model.lora.alpha=8", "learning_rate=5e-2", "keep_last=2",
]  # fmt: skip


def launch(args: list[str], resume: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "posttrain", "rl", *args, *(["--resume", "auto"] if resume else [])]
    # the reward function is named by its path, tests.train.resume_cases, importable from the repo root
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> None:
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err


def metrics(run: Path) -> list[dict]:
    rows = read_jsonl(run / "metrics.jsonl")
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))} for row in rows]


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "adapter" / "adapter_model.safetensors")


def phase(run: Path) -> str:
    """Where a killed run had got to, from what it left on disk."""
    steps = [row["step"] for row in read_jsonl(run / "metrics.jsonl")] if (run / "metrics.jsonl").exists() else []
    if (run / "final").exists():
        return "saving the final model or report"
    return f"after step {max(steps)}" if steps else "before step 1"


def test_runs_killed_at_random_instants_resume_to_the_straight_run_bitwise(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", rows_with_dead_steps(DEAD, STEPS))
    straight = tmp_path / "straight"
    started, process = time.monotonic(), launch(overrides(data, straight, STEPS, LORA_GRPO), resume=False)
    while not (straight / "metrics.jsonl").exists() and process.poll() is None:
        time.sleep(0.01)
    first_step = time.monotonic() - started  # start-up: imports, model, data, rewards
    finish(process)
    duration = time.monotonic() - started
    expected_metrics, expected_weights = metrics(straight), adapter(straight)
    assert [row["train/active_fraction"] for row in expected_metrics if row["step"] in DEAD] == [0.0] * len(DEAD)

    rng, phases = random.Random(23), []
    kills, chains, chain = 0, 0, None
    while kills < KILLS:
        if chain is None:  # a new run; killed, it continues in the same folder
            chains += 1
            chain, resume = tmp_path / f"killed-{chains}", False
        before = phase(chain)
        process = launch(overrides(data, chain, STEPS, LORA_GRPO), resume=resume)
        try:  # mostly past start-up, where a kill leaves something half-done
            process.wait(timeout=rng.uniform(0.6 * first_step, duration))
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills += 1
            resume = True
            phases.append(phase(chain) if phase(chain) != before else "starting")
            continue
        assert process.returncode == 0, process.stderr.read()
        assert metrics(chain) == expected_metrics, f"{chain}, after {kills} kills"
        chain = None  # finished before its kill: compared below with the others
    if chain is not None:
        finish(launch(overrides(data, chain, STEPS, LORA_GRPO), resume=True))
    print("phases at the kills:", phases)
    # the instants reached the run itself, not only its start-up
    assert sum(p.startswith("after step") for p in phases) >= 5, phases
    for number in range(1, chains + 1):
        run = tmp_path / f"killed-{number}"
        assert metrics(run) == expected_metrics, run
        weights = adapter(run)
        assert weights.keys() == expected_weights.keys()
        assert all(torch.equal(weights[k], expected_weights[k]) for k in weights), run
