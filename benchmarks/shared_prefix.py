#!/usr/bin/env python
"""A shared prompt prefix encoded once vs in every row, side by side.

Tool-use and chat runs start every prompt with the same system message (SmolLM2's function-calling
one and a tool schema: ~300 tokens), and a group's episodes share their whole first context. The
native decoder encodes a prefix all prompts of a batch share once and writes its keys and values
into every row (``NativeDecoder.MIN_SHARED``); this times ``engine.generate`` on ``--prompts``
prompts of a ``--prefix``-token system message plus a short question each, ``--samples`` samples
per prompt, ``--new-tokens`` new tokens, with the shared prefill on and off (``MIN_SHARED`` beyond
any prefix), taking turns, medians; and checks both sides sample the same greedy tokens.

    .venv/bin/python benchmarks/shared_prefix.py --model runs/smollm2/base   # SmolLM2-135M
    .venv/bin/python benchmarks/shared_prefix.py                              # the tiny model
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from timing import model_and_tokenizer, prompts_after_a_prefix, take_turns

from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt (n)")
    parser.add_argument("--prefix", type=int, default=300, help="tokens every prompt begins with")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = model_and_tokenizer(args.model)
    engine = build_engine(model, tokenizer, kind="native")
    draw = random.Random(0)
    prompts = prompts_after_a_prefix(len(tokenizer), args.prefix, args.prompts, draw)
    sampling = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, greedy=True)
    decoder, shared = engine.decoder, engine.decoder.MIN_SHARED
    outputs, prefilled = {}, {}

    def side(name: str, minimum: int):
        def run() -> None:
            decoder.MIN_SHARED = minimum
            outputs[name] = engine.generate(prompts, sampling)
            prefilled[name] = decoder.prefilled_tokens

        return run

    times = take_turns({"shared": side("shared", shared), "every_row": side("every_row", 10**9)}, args.repeats)
    same = torch.equal(outputs["shared"].response_ids, outputs["every_row"].response_ids)
    largest = float((outputs["shared"].logprobs - outputs["every_row"].logprobs).abs().max())
    print(json.dumps({
        "model": args.model or "tiny", "prompts": args.prompts, "samples": args.samples, "prefix": args.prefix,
        "new_tokens": args.new_tokens, "threads": args.threads, "shared_s": round(times["shared"], 4),
        "every_row_s": round(times["every_row"], 4), "speedup": round(times["every_row"] / times["shared"], 2),
        "prefilled_tokens": prefilled, "same_greedy_tokens": same, "max_logprob_difference": largest,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
