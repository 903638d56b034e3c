#!/usr/bin/env python
"""The output layer at the scored positions only vs at every response position, side by side.

A tool episode's response is mostly what the policy did not write — the environment's answers,
the chat template's turn markers — and, padded to the longest episode of its group, much
padding. The update's log-probs (models/logprobs.py ``scored_logprobs``) run the output layer
(SmolLM2: 49,152 × 576, a fifth of a position's work) only where a token is scored. This times
one micro-batch's forward and backward through ``shared_prompt_logprobs`` — a ``--prompt``-token
prompt, ``--samples`` responses ``--width`` positions wide of which ``--scored`` are the
policy's — with the real mask and with an all-ones mask (every position through the head, then
masked: the computation before), taking turns, medians; and checks the masked log-probs and the
gradients agree.

    .venv/bin/python benchmarks/scored_head.py --model runs/smollm2/base   # SmolLM2-135M
    .venv/bin/python benchmarks/scored_head.py                              # the tiny model
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import model_and_tokenizer, take_turns

from posttrain.models.logprobs import shared_prompt_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--width", type=int, default=200, help="response positions per row (the group's longest)")
    parser.add_argument("--scored", type=int, default=60, help="of them, the policy's tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = model_and_tokenizer(args.model)
    model.train()
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, vocab, (1, args.prompt), generator=generator)
    responses = torch.randint(4, vocab, (args.samples, args.width), generator=generator)
    mask = torch.zeros(args.samples, args.width)
    mask[:, : args.scored] = 1.0  # the policy's call, then the tool's answer and padding
    index = torch.zeros(args.samples, dtype=torch.long)
    results = {}

    def side(name: str, head_mask: torch.Tensor):
        def run() -> None:
            model.zero_grad(set_to_none=True)
            attended = torch.ones_like(mask)  # every response token is context (the tool's too)
            logprobs, _ = shared_prompt_logprobs(
                model, prompt, torch.ones_like(prompt), responses, head_mask, index, response_attention=attended
            )
            loss = (logprobs * mask).sum()
            loss.backward()
            first = next(p for p in model.parameters() if p.grad is not None)
            results[name] = ((logprobs * mask).detach(), first.grad.clone())

        return run

    sides = {"scored": side("scored", mask), "every_position": side("every_position", torch.ones_like(mask))}
    times = take_turns(sides, args.repeats)
    (a, ga), (b, gb) = results["scored"], results["every_position"]
    print(json.dumps({
        "model": args.model or "tiny", "prompt": args.prompt, "samples": args.samples, "width": args.width,
        "scored": args.scored, "threads": args.threads, "scored_s": round(times["scored"], 4),
        "every_position_s": round(times["every_position"], 4),
        "speedup": round(times["every_position"] / times["scored"], 2),
        "max_logprob_difference": float((a - b).abs().max()), "max_grad_difference": float((ga - gb).abs().max()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
