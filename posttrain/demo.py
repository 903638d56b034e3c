"""`posttrain demo`: the lecture's first example end to end — SFT cold start, then GRPO — on CPU.

Nothing is downloaded. A character tokenizer and a tiny Llama are built here, then:

1. **SFT** on a small *labelled* set of (name, reversed name) pairs, stopped early once exact
   match on a separate labelled validation set reaches ``sft_stop_accuracy``, so RL starts
   from a policy that is right about half the time (the lecture's 64.8%).
2. **GRPO** on a disjoint pool of *unlabelled* prompts with the 0/1 reward "text after
   `Answer:` up to the first `.` equals the reversed name" (the lecture's reward function).
3. **Baseline**: SFT continued from the same checkpoint on the same labelled set for the same
   training wall time as RL, so the report shows what RL adds over simply training longer.

Greedy exact match on 500 held-out names (the nine manual names first) is printed after SFT
and after RL, with the lecture's table. Run directory::

    sft/            the SFT run (the offline loop of ``posttrain sft``): metrics.jsonl,
                    checkpoints/, final/ (the SFT model, an HF folder), report.html
    rl/             the RL run: metrics.jsonl, samples.jsonl, report.html, final/
    sft_continued/  the baseline's SFT run, laid out as sft/
    report.html     the comparison: accuracy against training time, both tables
    summary.json    every number printed
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import posttrain
from posttrain.data.tasks.reverse import MANUAL_NAMES, make_rows, parse_answer, reverse_reward, split_names
from posttrain.evaluate import EvalResult, evaluate, sample_completions
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.types import SamplingParams
from posttrain.run.run_header import describe_device
from posttrain.telemetry.report import comparison_plot, write_report
from posttrain.train.offline import LoopConfig, train_offline
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import RLRun, load_rl_config
from posttrain.train.sft import SFTObjective

Echo = Callable[[str], None]


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    """Seeds the model's initial weights, the names, SFT shuffling and RL sampling."""
    output_dir: str = "runs/demo"
    """Run directory; files of an earlier run there are overwritten."""
    n_labelled: int = 2000
    """Labelled (name, reversed) pairs SFT trains on."""
    n_validation: int = 100
    """Labelled names kept aside to decide when SFT stops."""
    n_unlabelled: int = 20_000
    """Prompts (names only, no answers) RL samples from; disjoint from the labelled names."""
    n_test: int = 500
    """Held-out names, the nine manual examples first."""
    sft_max_steps: int = 400
    """SFT steps of 32 rows at most."""
    sft_stop_accuracy: float = 0.55
    """SFT stops at the first validation check at or above this exact match. Accuracy climbs
    through 40-70% within 20-40 steps, so checks are frequent; RL learns faster from the upper
    half of that window, where a sample at temperature 1 is right often enough to compare."""
    sft_check_every: int = 2
    """Validation check interval (SFT steps); a check of 100 names takes ~0.05 s."""
    rl: tuple[str, ...] = ()
    """``key=value`` overrides of the RL stage's config (``posttrain/demo_rl.yaml``: GRPO, 600
    steps of 32 prompts × 8 samples, ...); the command's --rl-steps, --max-staleness, --interrupt
    and --ray-workers are such overrides."""
    baseline: bool = True
    """Also run the continued-SFT baseline for the RL stage's training time."""
    threads: int | None = None
    """torch intra-op threads; None uses every core this process may run on."""
    log_every: int = 25
    """Progress line interval of the SFT stages (steps; the RL stage's is its config's log_every)."""


def available_cores() -> int:
    """Cores this process may use (respects CPU affinity, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def manual_examples_table(result: EvalResult) -> list[str]:
    """The lecture's table for the nine hand-picked names, then their accuracy line."""
    by_name = {sample["name"]: sample for sample in result.samples}
    lines, correct = [], 0
    for name in MANUAL_NAMES:
        sample = by_name[name]
        correct += sample["reward"] == 1.0
        mark = "✓" if sample["reward"] == 1.0 else "✗"
        lines.append(f"{name:<8} → {parse_answer(sample['completion']):<8} (expected: {name[::-1]:<8}) {mark}")
    n = len(MANUAL_NAMES)
    lines.append(f"Manual Examples Accuracy: {correct}/{n} = {100 * correct / n:.1f}%")
    return lines


def print_results(title: str, result: EvalResult, echo: Echo) -> None:
    """The lecture's printout: the manual table, then held-out accuracy and error count."""
    echo(f"\n{title}\nManual Examples:\n=====")
    for line in manual_examples_table(result):
        echo(line)
    errors = sum(sample["reward"] != 1.0 for sample in result.samples)
    echo(f"=====\nEvaluating on test set (sample size: {len(result.samples)})...")
    echo(f"Test Set Exact Match Accuracy: {100 * result.accuracy:.2f}%")
    echo(f"Number of errors: {errors}/{len(result.samples)}")


def sampled_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict], seed: int) -> float:
    """Exact match of one completion per prompt at temperature 1: the signal RL starts from."""
    prompts = [row["prompt"] for row in rows]
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=seed)
    completions, ids = sample_completions(model, tokenizer, prompts, sampling)
    rewards = reverse_reward(prompts, completions, ids)
    model.train()
    return sum(r for r in rewards if r is not None) / len(rewards)


def _sft_loop_config(config: DemoConfig, out: Path, steps: int, seed: int) -> LoopConfig:
    """The demo's SFT settings: 32 rows a step at 1e-3 after 20 warm-up steps, constant rate."""
    return LoopConfig(
        steps=steps,
        batch_size=32,
        learning_rate=1e-3,
        warmup_steps=20,
        seed=seed,
        output_dir=str(out),
        overwrite=True,  # the demo redoes its own stages when run again
        report_to=[],
    )


def _sft_stage(
    config: DemoConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    labelled: list[dict],
    validation: list[dict],
    out: Path,
    echo: Echo,
) -> dict[str, Any]:
    """SFT (the offline loop) with an early stop on validation exact match; the run in ``out``."""
    state: dict[str, Any] = {"validation": 0.0, "eval_s": 0.0, "steps": 0}

    def on_step(step: int, metrics: dict[str, float]) -> bool:
        state["steps"] = step
        stop = False
        if step % config.sft_check_every == 0 and step >= 60:
            t0 = time.perf_counter()
            state["validation"] = evaluate(model, tokenizer, validation, reverse_reward).accuracy
            state["eval_s"] += time.perf_counter() - t0
            metrics["eval/validation_accuracy"] = state["validation"]
            stop = state["validation"] >= config.sft_stop_accuracy
        if step % config.log_every == 0 or stop:
            echo(
                f"[sft] step {step:>4}  loss {metrics['loss/sft']:.4f}  validation exact match "
                f"{100 * state['validation']:.0f}%  elapsed {metrics['time/elapsed_s']:.1f} s"
            )
        return stop

    objective = SFTObjective(model, tokenizer)
    loop = _sft_loop_config(config, out, config.sft_max_steps, config.seed)
    history = train_offline(objective, _encoded(objective, labelled), loop, on_step=on_step, show_progress=False)
    seconds = history[-1]["time/elapsed_s"] - state["eval_s"] if history else 0.0
    return {"steps": state["steps"], "validation_accuracy": state["validation"], "train_seconds": seconds}


def _encoded(objective: SFTObjective, rows: list[dict]) -> list[Any]:
    return [objective.encode(row) for row in rows]


def rl_stage_config(config: DemoConfig, out: Path) -> RLRun:
    """The RL stage's config: ``demo_rl.yaml`` with the demo's seed, folder, held-out size and
    threads, then ``config.rl``'s overrides; checked before any stage runs."""
    with resources.as_file(resources.files("posttrain") / "demo_rl.yaml") as path:
        fixed = [f"seed={config.seed}", f"output_dir={out}", f"eval_size={config.n_test}"]
        fixed += [f"threads={config.threads}"] if config.threads else []
        return load_rl_config(path, [*fixed, *config.rl])


def _rl_stage(
    config: RLRun,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[dict],
    test_rows: list[dict],
    echo: Echo,
) -> tuple[list[dict[str, float]], EvalResult]:
    """GRPO on the unlabelled prompts (the RL loop, in ``config.output_dir``): its metrics and last evaluation."""
    rl = OnlineRL(
        config,
        model=model,
        tokenizer=tokenizer,
        reward_functions=[reverse_reward],
        train_rows=prompts,
        held_out_rows=test_rows,
        echo=echo,
    )
    history = rl.run()
    return history, rl.last_eval


def _baseline_stage(
    config: DemoConfig,
    tokenizer: PreTrainedTokenizerBase,
    sft_dir: Path,
    labelled: list[dict],
    test_rows: list[dict],
    budget_s: float,
    out: Path,
    echo: Echo,
) -> list[tuple[float, float]]:
    """SFT continued from the SFT checkpoint for ``budget_s`` seconds of training; returns
    (training seconds, held-out accuracy) points, evaluations not counted as training time."""
    from posttrain.models.loading import load_causal_lm

    model = load_causal_lm(sft_dir).train()
    points: list[tuple[float, float]] = []
    state = {"eval_s": 0.0}
    interval = max(budget_s / 6, 1.0)
    next_eval = interval

    def on_step(step: int, metrics: dict[str, float]) -> bool:
        nonlocal next_eval
        trained = metrics["time/elapsed_s"] - state["eval_s"]
        done = trained >= budget_s
        if trained >= next_eval or done:
            t0 = time.perf_counter()
            accuracy = evaluate(model, tokenizer, test_rows, reverse_reward).accuracy
            state["eval_s"] += time.perf_counter() - t0
            points.append((trained, accuracy))
            metrics["eval/accuracy"] = accuracy
            next_eval += interval
            echo(f"[sft-continued] {trained:5.1f} s of {budget_s:.0f} s  held-out exact match {100 * accuracy:.1f}%")
        return done

    objective = SFTObjective(model, tokenizer)
    loop = _sft_loop_config(config, out, 10**6, config.seed + 1)  # stopped by the time budget
    train_offline(objective, _encoded(objective, labelled), loop, on_step=on_step, show_progress=False)
    return points


def _demo_rows(config: DemoConfig) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """Disjoint names: (validation, labelled, unlabelled prompts, held-out test), seeded."""
    train_names, test_names = split_names(
        config.n_validation + config.n_labelled + config.n_unlabelled, config.n_test, seed=config.seed
    )
    validation = make_rows(train_names[: config.n_validation])
    labelled = make_rows(train_names[config.n_validation : config.n_validation + config.n_labelled])
    # RL sees prompts only: the answers of this pool are never used
    unlabelled = [
        {"prompt": row["prompt"]} for row in make_rows(train_names[config.n_validation + config.n_labelled :])
    ]
    return validation, labelled, unlabelled, make_rows(test_names)


def _announce(config: DemoConfig, model: Any, tokenizer: Any, rows: tuple[list, ...], echo: Echo) -> int:
    """Print what runs (versions, threads, model, data sizes); returns the model's parameter count."""
    labelled, validation, unlabelled, test_rows = rows
    out = config.output_dir
    n_params = sum(p.numel() for p in model.parameters())
    echo(
        f"[demo] posttrain {posttrain.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"seed {config.seed}, output {out}"
    )
    echo(f"[demo] device: {describe_device(LoopConfig(output_dir=str(out)))} (device=auto: a GPU when one is visible)")
    echo(
        f"[demo] tiny llama 2 layers x 128 hidden, {n_params:,} parameters, vocab {len(tokenizer)}; "
        f"{len(labelled)} labelled + {len(validation)} validation names for SFT, {len(unlabelled)} unlabelled "
        f"prompts for RL, {len(test_rows)} held out"
    )
    return n_params


def run_demo(config: DemoConfig, echo: Echo = print) -> dict[str, Any]:
    """SFT, evaluate, GRPO, evaluate, baseline, report; returns the summary it writes."""
    started = time.perf_counter()
    out = Path(config.output_dir)
    rl_config = rl_stage_config(config, out / "rl")  # a bad override stops here, before any stage
    torch.set_num_threads(config.threads or available_cores())
    torch.manual_seed(config.seed)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        len(tokenizer), arch="llama", layers=2, hidden=128, heads=4, seed=config.seed, tokenizer=tokenizer
    )
    validation, labelled, unlabelled, test_rows = _demo_rows(config)
    n_params = _announce(config, model, tokenizer, (labelled, validation, unlabelled, test_rows), echo)

    # 1. SFT cold start
    sft = _sft_stage(config, model, tokenizer, labelled, validation, out / "sft", echo)
    after_sft = evaluate(model, tokenizer, test_rows, reverse_reward)
    sampled = sampled_accuracy(model, tokenizer, test_rows, config.seed)
    print_results(f"After SFT ({sft['steps']} steps, {sft['train_seconds']:.1f} s):", after_sft, echo)
    echo(f"Sampled (temperature 1) exact match, the signal RL starts from: {100 * sampled:.2f}%\n")

    # 2. GRPO on unlabelled prompts
    history, after_rl = _rl_stage(rl_config, model, tokenizer, unlabelled, test_rows, echo)
    rl_seconds = sum(h.get("time/step_s", 0.0) for h in history)
    print_results(f"After GRPO ({rl_config.steps} steps, {rl_seconds:.1f} s):", after_rl, echo)

    # 3. the baseline: as much more SFT, on the labelled data, as RL got time
    baseline_points: list[tuple[float, float]] = []
    if config.baseline:
        echo(f"\n[demo] baseline: SFT continued on the labelled set for the same {rl_seconds:.0f} s of training")
        baseline_points = _baseline_stage(
            config, tokenizer, out / "sft" / "final", labelled, test_rows, rl_seconds, out / "sft_continued", echo
        )

    summary = {
        "config": asdict(config),
        "rl_steps": rl_config.steps,
        "parameters": n_params,
        "sft": sft,
        "accuracy_after_sft": after_sft.accuracy,
        "sampled_accuracy_after_sft": sampled,
        "accuracy_after_rl": after_rl.accuracy,
        "rl_train_seconds": rl_seconds,
        "accuracy_sft_continued": baseline_points[-1][1] if baseline_points else None,
        "total_seconds": time.perf_counter() - started,
    }
    _write_report(out, summary, history, after_sft.accuracy, baseline_points, after_sft, after_rl)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, len(test_rows), out, echo)
    return summary


def _print_summary(summary: dict[str, Any], n_test: int, out: Path, echo: Echo) -> None:
    continued = summary["accuracy_sft_continued"]
    echo(
        f"\n[demo] exact match on {n_test} held-out names: {100 * summary['accuracy_after_sft']:.1f}% after SFT -> "
        f"{100 * summary['accuracy_after_rl']:.1f}% after GRPO"
        + (f" (SFT continued for the same time: {100 * continued:.1f}%)" if continued is not None else "")
    )
    echo(f"[demo] report: {out / 'report.html'}  ({summary['total_seconds']:.0f} s in all)")


def _write_report(
    out: Path,
    summary: dict[str, Any],
    history: list[dict[str, float]],
    sft_accuracy: float,
    baseline_points: list[tuple[float, float]],
    after_sft: EvalResult,
    after_rl: EvalResult,
) -> None:
    elapsed, rl_points = 0.0, [(0.0, sft_accuracy)]
    for record in history:
        elapsed += record.get("time/step_s", 0.0)
        if "eval/accuracy" in record:
            rl_points.append((elapsed, record["eval/accuracy"]))
    curves = {"GRPO on unlabelled prompts": rl_points}
    if baseline_points:
        curves["SFT continued on the labelled set"] = [(0.0, sft_accuracy), *baseline_points]
    comparison_plot(
        curves,
        out / "demo_comparison.png",
        title="Held-out exact match after the SFT checkpoint",
        xlabel="training seconds after SFT",
        ylabel="exact match (500 names)",
    )
    write_report(
        out,
        title="posttrain demo: reverse names, SFT then GRPO",
        figures=["demo_comparison.png"],
        summary={SUMMARY_LABELS.get(k, k): v for k, v in summary.items() if not isinstance(v, dict) and v is not None},
        preformatted={
            "After SFT": "\n".join(manual_examples_table(after_sft)),
            "After GRPO": "\n".join(manual_examples_table(after_rl)),
        },
        links=_stage_links(out, "."),
    )
    for stage in ("sft", "rl", "sft_continued"):  # each stage's own report links back to the others
        if (out / stage / "metrics.jsonl").is_file():
            write_report(out / stage, title=f"posttrain demo, {STAGE_TITLES[stage]}", links=_stage_links(out, stage))


SUMMARY_LABELS = {
    "rl_steps": "GRPO steps",
    "parameters": "parameters",
    "accuracy_after_sft": "held-out exact match after SFT",
    "sampled_accuracy_after_sft": "sampled exact match after SFT (what RL starts from)",
    "accuracy_after_rl": "held-out exact match after GRPO",
    "rl_train_seconds": "GRPO training seconds",
    "accuracy_sft_continued": "held-out exact match, SFT continued as long",
    "total_seconds": "seconds in all",
}
"""The report's names for ``summary.json``'s keys."""
STAGE_TITLES = {"sft": "stage 1: SFT", "rl": "stage 2: GRPO", "sft_continued": "baseline: SFT continued"}


def _stage_links(out: Path, here: str) -> dict[str, str]:
    """Links from the report in ``out/here`` to the demo's other reports."""
    pages = {"the demo": "report.html"} | {STAGE_TITLES[s]: f"{s}/report.html" for s in STAGE_TITLES}
    prefix = "" if here == "." else "../"
    return {
        title: prefix + page
        for title, page in pages.items()
        if (out / page).parent.resolve() != (out / here).resolve() and (out / page).parent.is_dir()
    }
