#!/usr/bin/env python
"""A multi-turn episode's next turn with the last turn's keys and values kept vs encoded again, side by side.

Turn 2 of a tool episode is prompted with turn 1's whole context (a ~300-token system message
with the tool list, the task), the policy's call and the tool's answer. With
``SamplingParams.keep_cache`` (what the environment source asks for while more turns may follow)
the native engine keeps each row's keys and values and turn 2 encodes only what it adds
(rollout/turn_cache.py); without it turn 2 encodes the whole conversation again. This times both
turns of ``--prompts`` episodes, ``--samples`` per prompt (a group's first turn is one prompt
sampled n times), ``--new-tokens`` per turn, a ``--answer``-token tool answer in between, the two
ways taking turns, medians; and checks both sample the same greedy tokens.

    .venv/bin/python benchmarks/turn_cache.py --model runs/smollm2/base   # SmolLM2-135M
    .venv/bin/python benchmarks/turn_cache.py                              # the tiny model
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
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    parser.add_argument("--prefix", type=int, default=300, help="tokens every prompt begins with")
    parser.add_argument("--answer", type=int, default=12, help="tokens of the tool's answer between the turns")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = model_and_tokenizer(args.model)
    engine = build_engine(model, tokenizer, kind="native")
    draw = random.Random(0)
    prompts = prompts_after_a_prefix(len(tokenizer), args.prefix, args.prompts, draw)
    answer = [draw.choice(range(4, min(len(tokenizer), 5000))) for _ in range(args.answer)]
    outputs, prefilled = {}, {}

    def episode(name: str, keep: bool):
        def run() -> None:
            first = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, greedy=True, keep_cache=keep)
            turn = engine.generate(prompts, first)
            replies = [turn.response_ids[row, : int(n)].tolist() for row, n in enumerate(turn.response_lengths)]
            second = [prompts[row // args.samples] + reply + answer for row, reply in enumerate(replies)]
            outputs[name] = engine.generate(second, SamplingParams(max_new_tokens=args.new_tokens, greedy=True))
            prefilled[name] = engine.decoder.prefilled_tokens

        return run

    times = take_turns({"kept": episode("kept", True), "encoded_again": episode("encoded_again", False)}, args.repeats)
    same = torch.equal(outputs["kept"].response_ids, outputs["encoded_again"].response_ids)
    largest = float((outputs["kept"].logprobs - outputs["encoded_again"].logprobs).abs().max())
    print(json.dumps({
        "model": args.model or "tiny", "prompts": args.prompts, "samples": args.samples, "prefix": args.prefix,
        "answer": args.answer, "new_tokens": args.new_tokens, "threads": args.threads,
        "kept_s": round(times["kept"], 4), "encoded_again_s": round(times["encoded_again"], 4),
        "speedup": round(times["encoded_again"] / times["kept"], 2), "turn_2_prefilled_tokens": prefilled,
        "same_greedy_tokens": same, "max_logprob_difference": largest,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
