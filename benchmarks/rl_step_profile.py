"""Where an RL step's time goes (generate / reference / update) and the peak memory, for variants
of one config run side by side from the same start: a few steps each, in its own process.

The default compares the ways SmolLM2-135M's LoRA GRPO step can store activations
(``configs/smollm2_arithmetic.yaml``, from the self-distilled SFT model of
``examples/smollm2_learns.py``):

- ``checkpointed``: gradient checkpointing, 8 samples per micro-batch (the full forward: a
  checkpointed model keeps no KV cache, so each sample re-encodes its prompt);
- ``one_group``: no checkpointing, one group (4 samples) per micro-batch, its prompt encoded once;
- ``two_groups``: no checkpointing, 8 samples per micro-batch;
- ``derived``: no checkpointing, no bound set: ``micro_batch_tokens`` derived from the memory plan;
- ``packed``: ``derived`` with padding-free passes (``padding_free``, models/packing.py);
- ``ppo_full_critic`` / ``ppo_light_critic``: PPO (GAE) beside the LoRA policy with a critic trained
  in full (``algorithm.critic.lora=false``) or the light critic, both with derived passes.

Dynamic sampling is off in every variant: it changes how many rounds a step generates, not the update.

    .venv/bin/python benchmarks/rl_step_profile.py --model runs/smollm2/arithmetic-0/sft/final --steps 4

Each variant's medians over its steps after the first (the first warms up), and the ratio of each
median to the first variant's; peak RSS of the variant's process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "checkpointed": ["model.gradient_checkpointing=true", "micro_batch_size=8"],
    "one_group": ["model.gradient_checkpointing=false", "micro_batch_size=4"],
    "two_groups": ["model.gradient_checkpointing=false", "micro_batch_size=8"],
    # no bound set: the passes are sized by the memory plan (plan/micro_batch_budget.py)
    "derived": ["model.gradient_checkpointing=false", "micro_batch_size=null"],
    # the same, padding-free: samples end to end in one row, each prompt computed with its sample
    "packed": ["model.gradient_checkpointing=false", "micro_batch_size=null", "padding_free=true"],
    # PPO's critic beside the LoRA policy: a full copy trained in full, or the light critic (its own
    # adapters and head over the policy's shared base, models/adapter_critic.py)
    "ppo_full_critic": ["model.gradient_checkpointing=false", "algorithm=ppo", "algorithm.critic.lora=false"],
    "ppo_light_critic": ["model.gradient_checkpointing=false", "algorithm=ppo"],
}
MEASURE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
PHASES = ("time/generate_s", "time/prepare_s", "time/train_s", "time/step_s")


def run_variant(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Medians of the phases over the variant's steps after the first, and its peak RSS (GiB)."""
    out = Path(args.output_dir) / name
    command = [sys.executable, "-m", "posttrain", "rl", "--config", str(args.config), f"model.path={args.model}",
               f"output_dir={out}", "overwrite=true", f"steps={args.steps}", "eval_size=0", f"seed={args.seed}",
               "algorithm.dynamic_sampling.enabled=false", *overrides, *args.overrides]  # fmt: skip
    # a fresh wrapper process per variant: its children's peak RSS is this variant's alone
    measured = subprocess.run([sys.executable, "-c", MEASURE, *command], cwd=ROOT, capture_output=True, text=True)
    if measured.returncode != 0:
        sys.exit(f"variant {name} failed:\n{measured.stderr[-4000:]}")
    peak_kib = measured.stdout.split()[-1]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "time/step_s" in s][1:]
    medians = {phase.split("/")[1]: statistics.median(s[phase] for s in steps) for phase in PHASES}
    return {**medians, "peak_rss_gib": int(peak_kib) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arithmetic.yaml")
    parser.add_argument("--model", required=True, help="the RL start, e.g. runs/smollm2/arithmetic-0/sft/final")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--output-dir", default="/tmp/rl_step_profile")
    parser.add_argument("overrides", nargs="*", help="key=value for every variant")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up and not counted")
    results = {name: run_variant(name, VARIANTS[name], args) for name in args.variants}
    base = results[args.variants[0]]
    for name in args.variants:
        ratios = {k: round(v / base[k], 2) for k, v in results[name].items() if base[k]}
        print(json.dumps({"variant": name, **{k: round(v, 2) for k, v in results[name].items()}, "ratio": ratios}))


if __name__ == "__main__":
    main()
