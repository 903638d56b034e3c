#!/usr/bin/env python
"""SFT step time, posttrain vs TRL's SFTTrainer, on the same model, data and batch, in one run.

TRL runs ``../shared/benchmarks/trl_reverse.py --skip-grpo`` in its own virtual environment
(``.venv-trl``; see ``../shared/benchmarks/README.md``), which builds the tiny model and the
character tokenizer into a work folder and fine-tunes it. posttrain then loads *that same*
initial model folder by path and trains it on the same names with the same batch size,
learning rate and schedule. Setup and evaluation are excluded from both step times.

    .venv/bin/python benchmarks/sft_vs_trl.py --sft-steps 170
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_SCRIPT = HERE.parent.parent / "shared" / "benchmarks" / "trl_reverse.py"


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=str(HERE.parent / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--trl-script", default=str(TRL_SCRIPT))
    parser.add_argument("--repeats", type=int, default=1, help="run both sides this many times, alternating")
    ours, shared = parser.parse_known_args()
    return ours, shared  # the rest are trl_reverse.py flags, reused verbatim


def run_trl(args: argparse.Namespace, shared: list[str], workdir: str) -> dict:
    command = [args.trl_python, args.trl_script, "--skip-grpo", "--workdir", workdir, *shared]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"TRL run failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_posttrain(trl_args: argparse.Namespace, workdir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.train.offline import LoopConfig, train_offline
    from posttrain.train.sft import SFTObjective

    torch.set_num_threads(trl_args.threads)
    spec = importlib.util.spec_from_file_location("trl_reverse", TRL_SCRIPT)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    train_names, _ = reference.make_names(
        trl_args.n_train, trl_args.n_test, trl_args.min_len, trl_args.max_len, trl_args.seed
    )
    tokenizer = AutoTokenizer.from_pretrained(Path(workdir) / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(Path(workdir) / "init_model")
    objective = SFTObjective(model, tokenizer)
    rows = [{"prompt": reference.make_prompt(n), "completion": f" {n[::-1]}."} for n in train_names]
    examples = [objective.encode(row) for row in rows]
    config = LoopConfig(
        steps=trl_args.sft_steps,
        batch_size=trl_args.sft_batch_size,
        learning_rate=trl_args.sft_lr,
        warmup_steps=trl_args.sft_warmup_steps,
        lr_scheduler=trl_args.sft_scheduler,
        seed=trl_args.seed,
        output_dir=tempfile.mkdtemp(prefix="posttrain_sft_bench_"),
        log_every=10**9,
    )
    started = time.perf_counter()
    history = train_offline(objective, examples, config)
    wall = time.perf_counter() - started
    step_times = [b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in itertools.pairwise(history)]
    return {
        "wall_s_incl_final_save": round(wall, 2),
        "sft_s_per_step": round(history[-1]["time/elapsed_s"] / len(history), 4),
        "median_step_s": round(statistics.median(step_times), 4),
        "final_loss": round(history[-1]["loss/sft"], 4),
    }


def main() -> None:
    ours, shared = parse_args()
    spec = importlib.util.spec_from_file_location("trl_reverse", TRL_SCRIPT)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    trl_args = reference.parse_args(shared)
    rows = []
    for repeat in range(ours.repeats):
        workdir = tempfile.mkdtemp(prefix="sft_bench_")
        trl = run_trl(ours, shared, workdir)
        mine = run_posttrain(trl_args, workdir)
        rows.append({"repeat": repeat, "trl_s_per_step": trl["sft_s_per_step"], "trl_acc": trl["sft_acc"], **mine})
        print(
            f"[repeat {repeat}] TRL {trl['sft_s_per_step']:.4f} s/step (acc {trl['sft_acc']:.3f})  "
            f"posttrain {mine['sft_s_per_step']:.4f} s/step  "
            f"ratio {mine['sft_s_per_step'] / trl['sft_s_per_step']:.2f}",
            flush=True,
        )
    ratio = statistics.median(r["sft_s_per_step"] / r["trl_s_per_step"] for r in rows)
    summary = {
        "bench": "sft_vs_trl",
        "steps": trl_args.sft_steps,
        "batch_size": trl_args.sft_batch_size,
        "threads": trl_args.threads,
        "cpu_count": os.cpu_count(),
        "median_ratio_posttrain_over_trl": round(ratio, 3),
        "runs": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
