#!/usr/bin/env python
"""Sampling speed: posttrain's rollout engines vs transformers ``generate``, side by side.

The tiny model of ``../shared/benchmarks/trl_reverse.py`` (Llama, 2 layers × 128 hidden,
4 heads, character tokenizer), 8 reversal prompts × 8 samples = 64 sequences of exactly
``--new-tokens`` new tokens at temperature 1 (EOS never ends a row on either side, so the
work is equal). Every side is warmed up, then timed ``--repeats`` times; medians reported.
Also reports the largest difference between the engine's log-probs and a full forward pass.

    .venv/bin/python benchmarks/generation_speed.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from posttrain.data.tasks.reverse import make_prompt, split_names
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def max_logprob_error(model, rollouts) -> float:
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = rollouts.prompt_ids.shape[1]
    full = torch.log_softmax(logits[:, width - 1 : -1], dim=-1).gather(-1, rollouts.response_ids.unsqueeze(-1))
    error = (full.squeeze(-1) - rollouts.logprobs).abs() * rollouts.response_mask
    return float(error.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=128, heads=4, tokenizer=tokenizer).eval()
    names, _ = split_names(args.prompts, 9, seed=0)
    prompts = [tokenizer(make_prompt(n), add_special_tokens=False)["input_ids"] for n in names]
    # equal work on both sides: EOS is banned from ending a row (stop on an id no one samples)
    sampling = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0)
    never = tokenizer.unk_token_id

    encoded = tokenizer(
        [make_prompt(n) for n in names for _ in range(args.samples)],
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )

    def hf_generate():
        with torch.no_grad():
            model.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=never,
            )

    results = {"generate": timed(hf_generate, args.repeats)}
    engines = {kind: build_engine(model, tokenizer, kind) for kind in ("native", "transformers")}
    for kind, engine in engines.items():
        engine.eos_id = never  # same fixed-length work as generate
        results[kind] = timed(lambda engine=engine: engine.generate(prompts, sampling), args.repeats)
    new_tokens = args.prompts * args.samples * args.new_tokens
    errors = {kind: max_logprob_error(model, engine.generate(prompts, sampling)) for kind, engine in engines.items()}

    print(f"{'side':<14}{'ms/call':>10}{'tokens/s':>12}{'vs generate':>13}")
    for side, seconds in results.items():
        print(f"{side:<14}{seconds * 1e3:>10.1f}{new_tokens / seconds:>12.0f}{results['generate'] / seconds:>12.2f}x")
    print(
        f"max |engine log-prob - full forward log-prob|: native {errors['native']:.2e}, "
        f"transformers {errors['transformers']:.2e}"
    )
    print(
        json.dumps(
            {
                "bench": "generation_speed",
                "sequences": args.prompts * args.samples,
                "new_tokens": args.new_tokens,
                "threads": args.threads,
                "ms": {k: round(v * 1e3, 2) for k, v in results.items()},
                "speedup_native_over_generate": round(results["generate"] / results["native"], 2),
                "max_logprob_error": errors,
            }
        )
    )


if __name__ == "__main__":
    main()
