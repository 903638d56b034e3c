#!/usr/bin/env python
"""A device check, run wherever a GPU is available (and on the CPU, where it says the same things
slowly): GRPO steps on ``--device`` in fp32 and in bf16, side by side in one run, then (``--ddp N``)
an SFT run under torchrun with N processes against one process.

Reported, each as the bf16 / N-process figure over its baseline:

* GRPO: median step time, generated tokens per second, peak memory (CUDA: the allocator's peak;
  not measured on the CPU), the final loss (both finite);
* SFT: median step time of N processes vs 1 on the same global batch, and the largest difference
  of their logged losses (equal up to float rounding by construction: distributed.py).

    .venv/bin/python benchmarks/gpu_smoke.py --model runs/smollm2/base --device cuda --steps 5 --ddp 2
    .venv/bin/python benchmarks/gpu_smoke.py --device cpu --steps 3 --ddp 2       # tiny model, here
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

import torch

from posttrain.devices import resolve_device
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

TINY = ["model.tiny.layers=2", "model.tiny.hidden=128", "model.tiny.heads=4"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local model folder (default: a tiny model built here)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per precision (the first is not timed)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--ddp", type=int, default=0, help="also run SFT with this many torchrun processes vs 1")
    parser.add_argument("--output-dir", default=None)
    return parser.parse_args()


def peak_memory_mb(device: torch.device) -> float:
    """The allocator's peak on CUDA; NaN on the CPU, whose peak RSS spans the whole process (both runs)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return float("nan")


def grpo(args: argparse.Namespace, precision: str, out: Path) -> dict[str, float]:
    model = [f"model.path={args.model}"] if args.model else TINY
    overrides = [
        *model, "data.task=reverse", "data.n_train=256", "data.n_eval=9", "eval_size=0", "algorithm=grpo",
        f"steps={args.steps}", f"prompts_per_step={args.prompts}", f"samples_per_prompt={args.samples}",
        f"max_new_tokens={args.max_new_tokens}", "reward_workers=0", "preflight=false", "log_every=1000",
        f"device={args.device}", f"precision={precision}", f"output_dir={out / precision}", "report_to=[]",
    ]  # fmt: skip
    if args.model:
        overrides.append("model.lora.r=16")
    run = OnlineRL(load_rl_config(None, overrides), echo=lambda line: None)
    device = next(run.policy.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    history = run.run()
    timed = history[1:] or history
    return {
        "step_s": statistics.median(h["time/step_s"] for h in timed),
        "tokens_per_s": statistics.median(h["throughput/generated_tokens_per_s"] for h in timed),
        "peak_mb": peak_memory_mb(device),
        "loss": history[-1]["loss/policy"],
    }


def sft(processes: int, args: argparse.Namespace, out: Path) -> list[dict]:
    model = [f"model.path={args.model}"] if args.model else TINY
    run_dir = out / f"sft-{processes}"
    overrides = [*model, "data.task=reverse", "data.n_train=512", "data.n_eval=9", "eval_size=0", "steps=12",
                 "batch_size=16", f"device={args.device}", "report_to=[]", f"output_dir={run_dir}"]  # fmt: skip
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([*launcher, "-m", "posttrain", "sft", *overrides], check=True, env=env, capture_output=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "grad_norm" in r]


def median_step_s(history: list[dict]) -> float:
    """Median wall time between consecutive logged steps."""
    return statistics.median(b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in pairwise(history))


def main() -> int:
    args = parse_args()
    device = resolve_device(args.device)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="gpu_smoke-"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"[smoke] device {device} ({name}), model {args.model or 'tiny (2 x 128)'}, torch {torch.__version__}")
    results = {precision: grpo(args, precision, out) for precision in ("fp32", "bf16")}
    print("| GRPO | step s | tokens/s | peak MB | final loss |")
    print("|---|---|---|---|---|")
    for precision, r in results.items():
        peak = "—" if math.isnan(r["peak_mb"]) else f"{r['peak_mb']:.0f}"
        print(f"| {precision} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {peak} | {r['loss']:.4g} |")
    fp32, bf16 = results["fp32"], results["bf16"]
    step_ratio, memory_ratio = bf16["step_s"] / fp32["step_s"], bf16["peak_mb"] / fp32["peak_mb"]
    memory = "not measured on the CPU" if math.isnan(memory_ratio) else f"{memory_ratio:.2f}"
    print(f"bf16 / fp32: step time {step_ratio:.2f}, peak memory {memory}")
    if args.ddp > 1:
        one, many = sft(1, args, out), sft(args.ddp, args, out)
        times = [median_step_s(history) for history in (one, many)]
        gap = max(abs(a["loss/sft"] - b["loss/sft"]) for a, b in zip(one, many, strict=True))
        print(f"SFT, {args.ddp} processes vs 1 (same global batch): step time {times[1]:.3f} vs {times[0]:.3f} s "
              f"(ratio {times[1] / times[0]:.2f}), largest loss difference {gap:.2e}")  # fmt: skip
    print(f"[smoke] runs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
