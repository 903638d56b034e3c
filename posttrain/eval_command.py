"""``posttrain eval``: how good a model folder is on a task or a data file, for a person (a table of
greedy accuracy, pass@k and mean@k with their standard errors, then the failed examples) or for a
script (``--json``: one line); ``--output FILE`` keeps every completion with its reward."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def run_eval(args: argparse.Namespace) -> int:
    """``posttrain eval``: greedy accuracy (and pass@k, mean@k) of a model folder on a task or a data
    file; a table, the failed examples and, with ``--output``, every completion in a JSONL file."""
    from posttrain.evaluate import evaluate, sampled_eval
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    rows, reward = checked_inputs(args)  # everything but the weights first: a wrong flag costs no load
    source = {"data": args.data} if args.data is not None else {"task": args.task}
    if not args.json:
        what = f"--data {args.data}" if args.data is not None else f"task {args.task}"
        sampled_too = f" and {args.k} samples at temperature 1" if args.k > 1 else ""
        print(f"posttrain eval: {args.model} on {what}, {len(rows)} rows, greedy{sampled_too}")
    model, tokenizer = load_causal_lm(args.model).eval(), load_tokenizer(args.model)
    result = evaluate(model, tokenizer, rows, reward, max_new_tokens=args.max_new_tokens, stop=args.stop)
    report = {**source, "rows": len(rows), "greedy_accuracy": result.accuracy}
    report["greedy_accuracy_stderr"] = result.stderr
    if args.k > 1:
        sampled = sampled_eval(
            model, tokenizer, rows, reward, k=args.k, max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop
        )
        report[f"pass@{args.k}"] = sampled.pass_at_k
        report[f"mean@{args.k}"], report[f"mean@{args.k}_stderr"] = sampled.mean_at_k, sampled.mean_at_k_stderr
    if args.output is not None:
        write_completions(Path(args.output), result.samples)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(summary_table(report, args.k)))
        print("\n".join(failed_examples(result.samples, args.show_failed)))
        if args.output is not None:
            print(f"[eval] every completion, with its reward: {args.output}")
    return 0


def checked_inputs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
    """(the rows, the reward function) the flags name, each checked, and the model folder and
    ``--output`` checked too; a wrong one is a message naming its flag."""
    from posttrain.data import DataError
    from posttrain.data.tasks import get_task
    from posttrain.errors import PosttrainError
    from posttrain.models.loading import ModelLoadError, read_config
    from posttrain.rewards import resolve_reward

    if args.data is not None:  # a data file: its prompts (and columns), the first --n of them
        from posttrain.data import read_dataset

        rows, task_reward = read_dataset(args.data)[: args.n], None
    else:
        try:
            task = get_task(args.task)(1, args.n, args.seed)
        except PosttrainError as error:
            raise DataError(f"--task {args.task} --n {args.n}: {error}") from None
        rows, task_reward = task.held_out, task.reward
    rows = _templated(rows, args)
    if not (args.reward or task_reward):
        source = f"--data {args.data}" if args.data is not None else f"task {args.task!r}"
        raise DataError(f"{source} has no reward to score with; pass --reward (a built-in name or pkg.module:fn)")
    try:
        reward = resolve_reward(args.reward or task_reward).fn
    except PosttrainError as error:
        raise DataError(f"--reward: {error}") from None
    try:
        read_config(args.model)
    except ModelLoadError as error:
        raise ModelLoadError(f"--model: {error}") from None
    if args.output is not None and Path(args.output).exists():
        raise DataError(f"--output {args.output} exists: name a new file (nothing is overwritten)")
    return rows, reward


def _templated(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows through ``--prompt-template`` and ``--chat-template``, as the run's data section does."""
    from posttrain.data import DataError

    if args.prompt_template:
        from posttrain.data.prompt_templates import resolve_prompt_template, template_rows

        try:
            resolve_prompt_template(args.prompt_template)
        except ValueError as error:
            raise DataError(f"--prompt-template: {error}") from None
        rows = template_rows(rows, args.prompt_template)
    if args.chat_template:
        from posttrain.data.prompt_templates import chat_rows

        rows = chat_rows(rows)
    return rows


def summary_table(report: dict[str, Any], k: int) -> list[str]:
    """The figures as aligned lines: each mean with its standard error."""
    rows = [("greedy accuracy", report["greedy_accuracy"], report["greedy_accuracy_stderr"])]
    if k > 1:
        rows += [
            (f"pass@{k}", report[f"pass@{k}"], None),
            (f"mean@{k}", report[f"mean@{k}"], report[f"mean@{k}_stderr"]),
        ]
    lines = []
    for name, value, stderr in rows:
        error = f" ± {stderr:.3f}" if stderr is not None and stderr == stderr else ""  # NaN below two rows
        lines.append(f"  {name:<16} {value:.3f}{error}")
    return lines


def failed_examples(samples: list[dict[str, Any]], count: int) -> list[str]:
    """Up to ``count`` examples without full marks: prompt, completion, reward (and the reference)."""
    failed = [s for s in samples if s["reward"] is None or s["reward"] < 1.0]
    if not failed:
        return [f"every one of the {len(samples)} rows has full marks"]
    lines = [f"{len(failed)} of {len(samples)} rows without full marks; the first {min(count, len(failed))}:"]
    for sample in failed[:count]:
        lines.append(f"  prompt      {_one_line(sample['prompt'])}")
        lines.append(f"  completion  {_one_line(sample['completion'])}")
        if "reference" in sample:
            lines.append(f"  reference   {_one_line(sample['reference'])}")
        lines.append(f"  reward      {sample['reward']}")
    return lines


def write_completions(path: Path, samples: list[dict[str, Any]]) -> None:
    """Every row's completion, reward and whether it has full marks, one JSON line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("x", encoding="utf-8") as file:  # "x": never over a file written meanwhile
        for sample in samples:
            correct = None if sample["reward"] is None else sample["reward"] >= 1.0
            file.write(json.dumps({**sample, "correct": correct}, default=str) + "\n")


def _one_line(text: Any, limit: int = 100) -> str:
    text = repr(text) if not isinstance(text, str) else text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"
