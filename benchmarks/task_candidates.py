#!/usr/bin/env python
"""Which task can RL teach this model? The model's greedy score, pass@k and mean@k on candidate
reasoning-gym families, before any training (issue 22's first step).

A group-relative method learns from prompts whose samples are sometimes right: a family where the
model is never right (pass@k ≈ 0) gives GRPO nothing to reinforce, one where greedy is already
right has nothing left to gain. The widest gap between pass@k and the greedy score is the best
bet — unless one answer dominates: "majority" is the share of the commonest reference answer, what
a policy that always gives it scores (SmolLM2 on letter_counting learned exactly that: every
answer "1", right 69% of the time). Prompts go through ``--template`` and the model's chat
template, as ``configs/smollm2_*.yaml`` send them; "greedy score" is the task's own score (partial
credit included), pass@k counts a fully right answer among k samples at temperature 1.

    .venv/bin/python benchmarks/task_candidates.py --model runs/smollm2/base --device cuda   # ~2 min on a GPU
    .venv/bin/python benchmarks/task_candidates.py --model runs/smollm2/base --n 30 --k 4    # ~1 hour on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from posttrain.data.prompt_templates import chat_rows, template_rows
from posttrain.data.tasks.reasoning_gym import generate
from posttrain.devices import resolve_device
from posttrain.evaluate import evaluate, sampled_eval
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rewards import resolve_reward

TEMPLATE = (
    "{prompt}\nThink step by step inside <think> </think>, then write only the final number inside <answer> </answer>."
)
CANDIDATES = [
    ("gsm_symbolic", {}),
    ("chain_sum", {"max_terms": 3, "max_digits": 2}),
    ("chain_sum", {}),
    ("basic_arithmetic", {"max_terms": 3, "max_digits": 2, "operators": ["+", "-", "*"],
                          "allow_parentheses": False, "allow_negation": False}),
    ("leg_counting", {"min_animals": 1, "max_animals": 3, "max_instances": 3}),
    ("leg_counting", {}),
    ("letter_counting", {"min_words": 1, "max_words": 5}),
    ("number_sequence", {}),
    ("gcd", {"max_value": 100}),
    ("simple_equations", {"max_terms": 2, "max_value": 20}),
    ("count_bits", {"max_n": 255}),
    ("products", {}),
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--n", type=int, default=100, help="problems per family (held-out seed 2)")
    parser.add_argument("--k", type=int, default=8, help="samples per problem")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--template", default=TEMPLATE)
    parser.add_argument("--batch-size", type=int, default=512, help="sequences generated at once")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    model, tokenizer = load_causal_lm(args.model).eval().to(device), load_tokenizer(args.model)
    score = resolve_reward("reasoning_gym").fn
    settings = {"max_new_tokens": args.max_new_tokens, "stop": ["</answer>"], "batch_size": args.batch_size}
    print(f"| family | options | majority | greedy score | pass@{args.k} | mean@{args.k} score | greedy length | s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, options in CANDIDATES:
        start = time.perf_counter()
        rows = chat_rows(template_rows(generate(name, args.n, 2, options), args.template))
        majority = Counter(str(row["answer"]) for row in rows).most_common(1)[0][1] / len(rows)
        with torch.inference_mode():
            greedy = evaluate(model, tokenizer, rows, score, **settings)
            sampled = sampled_eval(model, tokenizer, rows, score, k=args.k, seed=0, **settings)
        lengths = [len(tokenizer(s["completion"])["input_ids"]) for s in greedy.samples]
        shown = json.dumps(options) if options else "defaults"
        figures = [majority, greedy.accuracy, sampled.pass_at_k, sampled.mean_at_k]
        cells = " | ".join(f"{x:.2f}" for x in figures)
        seconds = time.perf_counter() - start
        print(f"| `{name}` | {shown} | {cells} | {sum(lengths) / len(lengths):.0f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
