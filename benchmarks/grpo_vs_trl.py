#!/usr/bin/env python
"""GRPO, posttrain vs TRL's GRPOTrainer: same SFT checkpoint, model, names, reward and settings, one run.

For each seed:

1. TRL (``../shared/benchmarks/trl_reverse.py`` in ``.venv-trl``) builds the tiny model and the
   character tokenizer and runs SFT once, saving the checkpoint both sides start from.
2. TRL runs GRPO from it (``--load-sft``), in its own process.
3. posttrain runs GRPO from the same folder, in its own process, with the same prompts per
   step, group size, learning rate and schedule, temperature, completion length, KL β, loss
   aggregation (TRL's ``dapo`` = posttrain's ``token-mean``), reward scaling and reward
   semantics (TRL's script's ``extract_answer``); held-out accuracy is measured with the TRL
   script's own ``evaluate`` function on the same names.

Step time is GRPO wall time / steps on both sides, evaluation excluded; peak RSS is each GRPO
process's maximum resident set. Every trl_reverse.py flag is passed through verbatim:

    .venv/bin/python benchmarks/grpo_vs_trl.py --seeds 0 1 2 -- --sft-steps 170 --grpo-steps 100 \\
        --grpo-batch-size 64 --group-size 8 --grpo-lr 1e-4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_SCRIPT = HERE.parent.parent / "shared" / "benchmarks" / "trl_reverse.py"


def load_reference():
    spec = importlib.util.spec_from_file_location("trl_reverse", TRL_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_json(command: list[str]) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def posttrain_side(shared: list[str], sft_dir: str, out_dir: str) -> dict:
    """GRPO with posttrain from ``sft_dir``; runs in its own process (see ``--posttrain-side``)."""
    import torch

    from posttrain.config import validate_config
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.train.rl import OnlineRL
    from posttrain.train.rl_config import RLRun

    reference = load_reference()
    args = reference.parse_args(shared)
    torch.set_num_threads(args.threads)
    train_names, test_names = reference.make_names(args.n_train, args.n_test, args.min_len, args.max_len, args.seed)
    max_new = args.max_completion_length or (args.max_len + 4)
    rows = [{"prompt": reference.make_prompt(n), "target": n[::-1]} for n in train_names]

    def reverse_reward(prompts, completions, completion_ids, target, **columns):
        return reference.reverse_reward(prompts, completions, target)

    kl = {"placement": "loss", "estimator": "k3", "coef": args.beta} if args.beta else {"placement": "none"}
    loss_options = {"clip_low": 0.2}
    aggregation = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
    algorithm = {
        "advantage": "dr_grpo" if args.scale_rewards == "none" else "grpo",
        "advantage_options": {"std_scope": args.scale_rewards} if args.scale_rewards != "none" else {},
        "policy_loss": "ppo_clip",
        "loss_options": loss_options,
        "agg_mode": aggregation.get(args.loss_type, "token-mean"),
        "kl": kl,
    }
    config = validate_config(
        RLRun,
        {
            "model": {"path": sft_dir},
            "data": {"task": "reverse"},
            "algorithm": algorithm,
            "steps": args.grpo_steps,
            "prompts_per_step": args.grpo_batch_size // args.group_size,
            "samples_per_prompt": args.group_size,
            "ppo_epochs": args.num_iterations,
            "max_new_tokens": max_new,
            "sampling": {"temperature": args.temperature},
            "learning_rate": args.grpo_lr,
            "warmup_steps": args.grpo_warmup_steps,
            "eval_size": 0,
            "seed": args.seed,
            "output_dir": out_dir,
            "overwrite": True,  # the benchmark's own scratch run, redone each time
            "log_every": 10**9,
            "preflight": False,
            "reward_workers": 0,  # TRL scores in its own process too
        },
    )
    model, tokenizer = load_causal_lm(sft_dir), load_tokenizer(sft_dir)
    run = OnlineRL(
        config,
        model=model,
        tokenizer=tokenizer,
        reward_functions=[reverse_reward],
        train_rows=rows,
        echo=lambda s: None,
    )
    started = time.perf_counter()
    history = run.run()
    wall = time.perf_counter() - started
    steps = [h["time/step_s"] for h in history]
    accuracy, samples = reference.evaluate(model, tokenizer, test_names, max_new, args.eval_batch_size)
    return {
        "grpo_s_per_step": round(sum(steps) / len(steps), 4),
        "grpo_median_step_s": round(statistics.median(steps), 4),
        "grpo_wall_incl_save_s": round(wall, 2),
        "generate_fraction": round(sum(h["time/generate_s"] for h in history) / sum(steps), 3),
        "train_reward_first": history[0]["reward/mean"],
        "train_reward_last": history[-1]["reward/mean"],
        "final_acc": accuracy,
        "samples": samples,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=str(HERE.parent / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--posttrain-side", nargs=2, metavar=("SFT_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    ours, shared = parser.parse_known_args()
    shared = [s for s in shared if s != "--"]
    if ours.posttrain_side:
        print(json.dumps(posttrain_side(shared, *ours.posttrain_side)))
        return
    reference = load_reference()
    rows = []
    for seed in ours.seeds:
        flags = [*shared, "--seed", str(seed)]
        work = tempfile.mkdtemp(prefix=f"grpo_bench_{seed}_")
        sft_dir = os.path.join(work, "sft_shared")
        sft = run_json(
            [ours.trl_python, str(TRL_SCRIPT), *flags, "--workdir", work, "--skip-grpo", "--save-sft", sft_dir]
        )
        trl = run_json([ours.trl_python, str(TRL_SCRIPT), *flags, "--workdir", work, "--load-sft", sft_dir])
        mine = run_json(
            [sys.executable, __file__, "--posttrain-side", sft_dir, os.path.join(work, "posttrain"), "--", *flags]
        )
        row = {
            "seed": seed,
            "sft_acc": sft["sft_acc"],
            "trl_s_per_step": trl["grpo_s_per_step"],
            "posttrain_s_per_step": mine["grpo_s_per_step"],
            "ratio": round(mine["grpo_s_per_step"] / trl["grpo_s_per_step"], 3),
            "trl_peak_rss_mb": trl["peak_rss_mb"],
            "posttrain_peak_rss_mb": mine["peak_rss_mb"],
            "trl_final_acc": trl["final_acc"],
            "posttrain_final_acc": mine["final_acc"],
            "trl_reward_first_last": [trl["grpo_train_reward_first"], trl["grpo_train_reward_last"]],
            "posttrain_reward_first_last": [mine["train_reward_first"], mine["train_reward_last"]],
            "posttrain_median_step_s": mine["grpo_median_step_s"],
            "posttrain_generate_fraction": mine["generate_fraction"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    args = reference.parse_args(shared)
    summary = {
        "bench": "grpo_vs_trl",
        "flags": shared,
        "steps": args.grpo_steps,
        "prompts_x_group": [args.grpo_batch_size // args.group_size, args.group_size],
        "lr": args.grpo_lr,
        "cpu_count": os.cpu_count(),
        "median_ratio_posttrain_over_trl": round(statistics.median(r["ratio"] for r in rows), 3),
        "rss_ratio_max": round(max(r["posttrain_peak_rss_mb"] / r["trl_peak_rss_mb"] for r in rows), 3),
        "trl_final_acc": [r["trl_final_acc"] for r in rows],
        "posttrain_final_acc": [r["posttrain_final_acc"] for r in rows],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
