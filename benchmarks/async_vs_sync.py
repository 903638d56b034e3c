#!/usr/bin/env python
"""Asynchronous vs synchronous GRPO on the demo's reversal task, side by side in one run.

One SFT cold start (the demo's, early-stopped as the demo does) is trained once; the GRPO stage
of ``posttrain demo`` then runs from a fresh load of it for each ``rollout.max_staleness`` η in
``--etas`` (0 = the synchronous loop), one after the other in this process with the same torch
thread count. With η ≥ 1 the producer thread gets half of the threads and the learner the rest
(``rollout.producer_threads``' default; stated in the output).

Reported per η, as ratios against η = 0:

* **time to equal samples** — the learner's wall time over all steps (Σ ``time/step_s``: sampling
  or waiting for a batch, preparing, updating, handing weights over; held-out evaluations are
  not counted, and neither is the model load);
* **time to equal accuracy** — that wall time up to the first evaluation whose held-out exact match
  reaches ``--target`` (default: the synchronous run's final accuracy minus one point);
* the final held-out accuracy and the mean staleness of the samples trained on.

With ``--interrupt`` every η ≥ 1 runs twice, the second time with ``rollout.interrupt`` (batches
in flight switch to the learner's new weights mid-generation), shown as "η+i".

While an evaluation runs the producer may go on making up to η + 1 batches, which the next steps
then find ready: with many evaluations this favours async a little; ``--eval-every`` sets how often.

    .venv/bin/python benchmarks/async_vs_sync.py --seed 0 --etas 0 1 2 4 --rl-steps 300
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from posttrain.data.tasks.reverse import reverse_reward
from posttrain.demo import DemoConfig, _demo_rows, _sft_stage, available_cores, rl_stage_config
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.train.rl import OnlineRL


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--rl-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--sft-max-steps", type=int, default=400)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--interrupt", action="store_true", help="also run each eta >= 1 with rollout.interrupt")
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy to reach (0-1)")
    parser.add_argument("--output-dir", default="runs/bench_async")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    out = Path(args.output_dir)
    rl = (f"steps={args.rl_steps}", f"eval_every={args.eval_every}", f"log_every={max(args.rl_steps // 4, 1)}")
    config = DemoConfig(
        seed=args.seed, output_dir=str(out), sft_max_steps=args.sft_max_steps, baseline=False, threads=threads, rl=rl
    )
    validation, labelled, unlabelled, test_rows = _demo_rows(config)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(args.seed)
    model = build_tiny_causal_lm(
        len(tokenizer), arch="llama", layers=2, hidden=128, heads=4, seed=args.seed, tokenizer=tokenizer
    )
    sft = _sft_stage(config, model, tokenizer, labelled, validation, out / "sft", lambda line: None)
    print(f"[bench] SFT: {sft['steps']} steps, validation exact match {100 * sft['validation_accuracy']:.1f}%")

    results = []
    runs = [(eta, False) for eta in args.etas]
    runs += [(eta, True) for eta in args.etas if eta >= 1 and args.interrupt]
    for eta, interrupt in runs:
        label = f"{eta}+i" if interrupt else str(eta)
        torch.set_num_threads(threads)
        policy = copy.deepcopy(model)  # every run starts from the same SFT weights
        variant = replace(config, rl=(*config.rl, f"rollout.max_staleness={eta}", f"rollout.interrupt={interrupt}"))
        rl_config = rl_stage_config(variant, out / f"rl-eta{eta}{'-interrupt' if interrupt else ''}")
        run = OnlineRL(
            rl_config,
            model=policy,
            tokenizer=tokenizer,
            reward_functions=[reverse_reward],
            train_rows=unlabelled,
            held_out_rows=test_rows,
            echo=lambda line: None,
        )
        started = time.perf_counter()
        history = run.run()
        total = time.perf_counter() - started
        elapsed, curve = 0.0, []
        for record in history:
            elapsed += record["time/step_s"]
            if "eval/accuracy" in record:
                curve.append((record["step"], elapsed, record["eval/accuracy"]))
        staleness = [h.get("async/staleness_mean", 0.0) for h in history]
        # per token (interrupted batches mix versions; a sample's own staleness is its oldest token's)
        token_staleness = [h.get("async/token_staleness_mean", h.get("async/staleness_mean", 0.0)) for h in history]
        results.append(
            {
                "eta": label,
                "train_s": elapsed,
                "run_s": total,
                "curve": curve,
                "final_accuracy": curve[-1][2] if curve else float("nan"),
                "staleness_mean": sum(staleness) / len(staleness),
                "token_staleness_mean": sum(token_staleness) / len(token_staleness),
                "learner_wait_s": sum(h.get("time/learner_wait_s", 0.0) for h in history),
            }
        )
        print(
            f"[bench] eta {label}: {elapsed:.1f} s of steps ({total:.1f} s with evaluations), held-out "
            f"{100 * results[-1]['final_accuracy']:.1f}%, curve {[(s, round(100 * a, 1)) for s, _, a in curve]}"
        )

    baseline = next((r for r in results if r["eta"] == "0"), results[0])
    target = args.target if args.target is not None else baseline["final_accuracy"] - 0.01
    for result in results:
        reached = next((t for _, t, accuracy in result["curve"] if accuracy >= target), None)
        result["time_to_target_s"] = reached
    producer = max(1, threads // 2)
    print(
        f"\nseed {args.seed}, {args.rl_steps} GRPO steps of 32 prompts x 8 samples, {threads} torch threads "
        f"(eta >= 1: producer {producer}, learner {max(1, threads - producer)}); target held-out accuracy "
        f"{100 * target:.1f}%"
    )
    print(
        "| eta | steps s | x sync | s to target | x sync | final held-out | mean staleness (samples) "
        "| (tokens) | learner waited s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        speed = baseline["train_s"] / r["train_s"]
        to_target = r["time_to_target_s"]
        base_target = baseline["time_to_target_s"]
        target_text = "not reached" if to_target is None else f"{to_target:.1f}"
        ratio = f"{base_target / to_target:.2f}" if to_target and base_target else "-"
        print(
            f"| {r['eta']} | {r['train_s']:.1f} | {speed:.2f} | {target_text} | {ratio} | "
            f"{100 * r['final_accuracy']:.1f}% | {r['staleness_mean']:.2f} | {r['token_staleness_mean']:.2f} | "
            f"{r['learner_wait_s']:.1f} |"
        )
    (out / "async_vs_sync.json").write_text(json.dumps({"target": target, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
