"""A run's headline from its metrics alone: held-out evaluation first → last, the batch reward,
the KL, the steps and the time. The report's summary and the command's closing lines say it.
Nothing here plots, so a command can print it without loading matplotlib."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from posttrain.telemetry.metrics import read_jsonl

Series = dict[str, tuple[list[int], list[float]]]
SKIP_KEYS = {"step"}
HEADLINE_EVAL = ("eval/accuracy", "eval/resolved", "eval/reward", "eval/loss")
"""The held-out metric a summary leads with: the first of these the run logged (a reward model's
and DPO's evaluations log ``eval/accuracy`` too)."""


def metric_series(records: list[dict[str, Any]]) -> Series:
    """``{key: (steps, values)}`` for every numeric metric, in step order."""
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for record in sorted(records, key=lambda r: r.get("step", 0)):
        for key, value in record.items():
            if key not in SKIP_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                series[key][0].append(int(record.get("step", 0)))
                series[key][1].append(float(value))
    return dict(series)


def run_headline(records: list[dict[str, Any]], series: dict) -> dict[str, str]:
    """The summary's lines from the metrics alone: held-out evaluation first → last, the batch
    reward first → last, the KL to the reference at the end, the steps and the training time."""
    lines: dict[str, str] = {}
    headline = next((key for key in HEADLINE_EVAL if key in series), None)
    if headline is not None:
        steps, values = series[headline]
        change = f"{number(values[0])} → {number(values[-1])}"
        lines[f"held out, {headline}"] = f"{change} (step {steps[0]} → {steps[-1]})"
    if "reward/mean" in series:
        values = series["reward/mean"][1]
        lines["reward, batch mean"] = f"{number(values[0])} → {number(values[-1])}"
    for key in ("kl/ref", "kl/mean"):
        if key in series:
            lines[f"KL to the reference ({key}), last"] = number(series[key][1][-1])
            break
    steps = [int(r["step"]) for r in records if r.get("step")]
    if steps:
        lines["steps"] = str(max(steps))
    seconds = sum(series["time/step_s"][1]) if "time/step_s" in series else None
    if seconds is None and "time/elapsed_s" in series:
        seconds = series["time/elapsed_s"][1][-1]
    if seconds is not None:
        lines["training time"] = f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return lines


def closing_lines(run_dir: str | Path) -> list[str]:
    """The headline of the run in ``run_dir`` as lines for the terminal ("held out, eval/accuracy:
    0.46 → 0.99 (step 0 → 600)"); none when it logged nothing."""
    records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    headline = run_headline(records, metric_series(records))
    return [f"{key}: {value}" for key, value in headline.items() if key not in ("steps",)]


def number(value: float) -> str:
    """A metric's value as a reader wants it: 4 significant digits."""
    return f"{value:.4g}" if math.isfinite(value) else str(value)
