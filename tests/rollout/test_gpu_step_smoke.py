"""benchmarks/gpu_step.py's checks pass on the CPU too (small sizes): the script a GPU session runs
is kept working by CI, which has no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_step_checks_pass_on_the_cpu(tmp_path):
    output = tmp_path / "lines.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks/gpu_step.py")
    command = [sys.executable, script, "--device", "cpu", "--cases", "check", "grpo", "memory"]
    run = subprocess.run([*command, "--output", str(output)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    checks = {line["check"]: line["passed"] for line in lines if line["case"] == "check"}
    assert len(checks) == 7 and all(checks.values()), checks
    steps = [line for line in lines if line["case"] == "grpo"]
    assert [s["graphs"] for s in steps] == [False, True] and all(s["step_s"] > 0 for s in steps)
    sized = [line for line in lines if line["case"] == "memory"]  # full fine-tuning, then LoRA
    assert [s["lora"] for s in sized] == [False, True] and all(s["micro_batch_tokens"] for s in sized)
