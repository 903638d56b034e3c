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
    command = [sys.executable, script, "--device", "cpu", "--cases", "check", "grpo", "memory", "step_profile"]
    command += ["--grpo-variants", "graphs", "graphs_packed"]  # sized by the plan; padding-free
    run = subprocess.run([*command, "--output", str(output)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    checks = {line["check"]: line["passed"] for line in lines if line["case"] == "check"}
    assert len(checks) == 12 and all(checks.values()), checks  # the jagged-kernel checks need CUDA
    assert checks["turn_cache_equals_a_full_prefill"] and checks["compiled_equals_eager_with_stops"]
    assert checks["packed_equals_padded_fp32"] and checks["packed_equals_padded_bf16"]
    steps = [line for line in lines if line["case"] == "grpo"]
    assert [s["variant"] for s in steps] == ["graphs", "graphs_packed"] and all(s["step_s"] > 0 for s in steps)
    assert all(s["micro_batch_tokens"] and s["micro_batch_size"] is None for s in steps)  # derived by the plan
    sized = [line for line in lines if line["case"] == "memory"]
    assert [s["variant"] for s in sized] == ["full", "lora_r16", "full_packed"]
    assert all(s["micro_batch_tokens"] and "error" not in s for s in sized)
    profiled = [line for line in lines if line["case"] == "step_profile"]  # steps 2-3 of a plan-sized run
    assert (
        len(profiled) == 1
        and profiled[0]["per_step_ms"] > 0
        and any(row[0] == "aten::mm" for row in profiled[0]["top"])
    )
