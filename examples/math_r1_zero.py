"""Seed 000, example 2, R1-Zero style: math word problems with a format reward and an answer reward.

Two stages, each one ``posttrain`` command with a shipped config:

1. ``posttrain sft --config configs/math_sft.yaml``: a short "cold start" on arithmetic word
   problems (``data.task: arithmetic``) whose completions show the format,
   ``<think> 3 + 5 = 8 </think><answer> 8 </answer>``, every prompt wrapped in DeepSeek-R1-Zero's
   instruction (``data.prompt_template: r1_zero``). It stops early on purpose, so that sampled
   answers are often malformed and rarely right.
2. ``posttrain rl --config configs/math_grpo.yaml``: GRPO (KL in the loss, k3) on the same kind
   of prompts with two 0/1 rewards, ``math`` (the answer is right) and ``format`` (the response
   is ``<think>…</think><answer>…</answer>`` and nothing else), summed.

This script runs both and then summarises the RL run: ``summary.json`` (format reward,
accuracy and response length before and after RL) and ``math_r1_zero.png`` (the three over RL
steps, the lecture's plot of response length during training among them), both also at the top
of the RL run's ``report.html``.

    python examples/math_r1_zero.py              # runs/math/{sft,grpo}
    python examples/math_r1_zero.py --quick      # the test's shortened version
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from posttrain.cli import main as posttrain
from posttrain.telemetry.metrics import read_jsonl
from posttrain.telemetry.report import rl_panels_plot, write_report

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# A smaller model, SFT and RL, for the test (about a minute): the direction of the effect only.
QUICK_SFT = ["steps=50", "batch_size=16", "data.n_eval=50"]
QUICK_RL = ["steps=20", "eval_every=0", "eval_size=50", "data.n_eval=50"]
WINDOW = 5  # RL steps averaged at each end of the sampled curves (one step is noisy)


def run_stages(out: Path, *, seed: int, sft_args: list[str], rl_args: list[str]) -> dict[str, float]:
    """SFT then GRPO through the command line, as a user would run them; wall time per stage."""
    times = {}
    start = time.perf_counter()
    sft = ["sft", "--config", str(CONFIGS / "math_sft.yaml"), f"output_dir={out / 'sft'}", f"seed={seed}"]
    sft.append("overwrite=true")  # the example's own stage folders: running it again redoes them
    if posttrain([*sft, *sft_args]) != 0:
        raise SystemExit("the SFT stage failed")
    times["sft_s"] = time.perf_counter() - start
    rl = ["rl", "--config", str(CONFIGS / "math_grpo.yaml"), f"model.path={out / 'sft' / 'final'}"]
    if posttrain([*rl, f"output_dir={out / 'grpo'}", "overwrite=true", f"seed={seed}", *rl_args]) != 0:
        raise SystemExit("the RL stage failed")
    times["rl_s"] = time.perf_counter() - start - times["sft_s"]
    return times


def summarise(rl_dir: Path, window: int = WINDOW) -> dict[str, Any]:
    """Greedy held-out format and accuracy before and after RL, and the sampled format reward,
    accuracy and response length averaged over the first and last `window` RL steps."""
    records = read_jsonl(rl_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/format/mean" in r]
    steps = [r for r in records if "reward/format/mean" in r]
    summary: dict[str, Any] = {
        "greedy_format": [evals[0]["eval/format/mean"], evals[-1]["eval/format/mean"]],
        "greedy_accuracy": [evals[0]["eval/math/mean"], evals[-1]["eval/math/mean"]],
    }
    for key, name in (("reward/format/mean", "sampled_format"), ("reward/math/mean", "sampled_accuracy")):
        summary[name] = [mean(r[key] for r in steps[:window]), mean(r[key] for r in steps[-window:])]
    lengths = [r["response/length_mean"] for r in steps]
    summary["response_length"] = [mean(lengths[:window]), mean(lengths[-window:])]
    summary["rl_steps"] = len(steps)
    return summary


def plot(rl_dir: Path, name: str = "math_r1_zero.png") -> Path:
    """Format reward, accuracy and response length over RL steps: sampled (each step's batch)
    and greedy on held-out prompts (the evaluations)."""
    panels = [
        ("format reward", "reward/format/mean", "eval/format/mean"),
        ("accuracy", "reward/math/mean", "eval/math/mean"),
        ("response length (tokens)", "response/length_mean", None),
    ]
    return rl_panels_plot(rl_dir, panels, rl_dir / name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/math", help="holds sft/ and grpo/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the test's shortened run (about a minute)")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    sft_args, rl_args = (QUICK_SFT, QUICK_RL) if args.quick else ([], [])
    times = run_stages(out, seed=args.seed, sft_args=sft_args, rl_args=rl_args)
    summary = {**summarise(out / "grpo"), **{k: round(v, 1) for k, v in times.items()}}
    (out / "grpo" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = plot(out / "grpo")
    shown = {k: " → ".join(f"{x:.3g}" for x in v) if isinstance(v, list) else v for k, v in summary.items()}
    write_report(out / "grpo", title="Math with format rewards (R1-Zero style)", figures=[figure.name], summary=shown)
    print(json.dumps(shown, indent=2, ensure_ascii=False))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
