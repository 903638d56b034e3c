"""A run killed with SIGKILL resumes exactly (issue 23, acceptance): ``posttrain rl`` with LoRA
and steps that train no sample is killed at 20 random instants (while it starts, samples,
updates, writes a checkpoint, deletes an old one, saves the final model or writes its report),
each time continued with ``--resume auto``; every chain of resumes ends on the straight run's
metrics and adapter weights, bit for bit.

Each kill is a real ``kill -9`` of a separate ``python -m posttrain`` process: nothing in memory
survives it, and whatever it was writing is left half-written."""

from __future__ import annotations

import json
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


def logged_step(run: Path) -> int:
    """The last step the run's metrics.jsonl records (0 if none); a line being written is skipped."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue
    return max(steps)


def kill_when(process: subprocess.Popen, run: Path, target: int, delay: float) -> bool:
    """SIGKILL `process` `delay` seconds after its run logged step `target` (0: after launch);
    False if it finished first."""
    while target and logged_step(run) < target and process.poll() is None:
        time.sleep(0.005)
    try:
        process.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
        return True


def test_runs_killed_at_random_instants_resume_to_the_straight_run_bitwise(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", rows_with_dead_steps(DEAD, STEPS))
    straight = tmp_path / "straight"
    started, process = time.monotonic(), launch(overrides(data, straight, STEPS, LORA_GRPO), resume=False)
    while not (straight / "metrics.jsonl").exists() and process.poll() is None:
        time.sleep(0.01)
    first_step = time.monotonic() - started  # start-up: imports, model, data, rewards
    while logged_step(straight) < STEPS and process.poll() is None:
        time.sleep(0.01)
    last_step = time.monotonic() - started
    finish(process)
    step_time = (last_step - first_step) / (STEPS - 1)
    closing = time.monotonic() - started - last_step  # the final model and the report
    expected_metrics, expected_weights = metrics(straight), adapter(straight)
    assert [row["train/active_fraction"] for row in expected_metrics if row["step"] in DEAD] == [0.0] * len(DEAD)

    # The instants are drawn from the run's own progress, not from the wall clock, so that a
    # slow or loaded machine moves them with the run: every fifth kill during start-up, the
    # others a random fraction of a step after a random step the run has not reached yet (the
    # last step: while it saves its final model and report). A run killed after its last step
    # is killed once more, during its start-up or final save, and then left to finish.
    rng, phases = random.Random(23), []
    kills, chains, chain, final_killed = 0, 0, None, False
    while kills < KILLS:
        if chain is None:  # a new run; killed, it continues in the same folder
            chains += 1
            chain, resume, final_killed = tmp_path / f"killed-{chains}", False, False
        done = logged_step(chain)
        process = launch(overrides(data, chain, STEPS, LORA_GRPO), resume=resume)
        if done == STEPS and final_killed:
            finish(process)
        else:
            if done == STEPS:
                target, delay, final_killed = 0, rng.uniform(0.2, 1.0) * (first_step + closing), True
            elif kills % 5 == 4:
                target, delay = 0, rng.uniform(0.2, 1.0) * first_step
            else:
                target, delay = rng.randint(done + 1, STEPS), rng.uniform(0.0, 1.5) * step_time
            if kill_when(process, chain, target, delay):
                kills += 1
                resume = True
                reached = logged_step(chain)
                phases.append(f"after step {reached}" if reached > done else "starting")
                # a kill timed from a step the run had not reached lands after that step
                assert target == 0 or reached >= target, (target, reached)
                continue
        assert process.returncode == 0, process.stderr.read()
        assert metrics(chain) == expected_metrics, f"{chain}, after {kills} kills"
        chain = None  # finished: compared below with the others
    if chain is not None:
        finish(launch(overrides(data, chain, STEPS, LORA_GRPO), resume=True))
    print("phases at the kills:", phases)
    # the instants reached the run itself, not only its start-up
    assert sum(p.startswith("after step") for p in phases) >= 10, phases
    for number in range(1, chains + 1):
        run = tmp_path / f"killed-{number}"
        assert metrics(run) == expected_metrics, run
        weights = adapter(run)
        assert weights.keys() == expected_weights.keys()
        assert all(torch.equal(weights[k], expected_weights[k]) for k in weights), run
