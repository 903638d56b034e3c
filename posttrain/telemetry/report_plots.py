"""The report's figures: the key curves a reader looks at first, an asynchronous run's staleness
histogram, and the comparison figures the examples draw (every metric's own small plot is inline
SVG: svg_plots.py).

Every function writes a PNG into the run directory and returns its path, so ``report.html``
opens offline and a figure can be pasted elsewhere."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt

from posttrain.telemetry.headline import Series, metric_series  # noqa: F401 (re-exported)
from posttrain.telemetry.metrics import read_jsonl


def is_constant(values: list[float]) -> bool:
    """Every finite value the same (a flat line says nothing a number would not)."""
    finite = [v for v in values if math.isfinite(v)]
    return len(set(finite)) <= 1


KEY_CURVES: list[tuple[str, Callable[[str], bool]]] = [
    ("reward", lambda key: key == "reward/mean" or (key.startswith("reward/") and key.endswith("/mean"))),
    ("held-out evaluation", lambda key: key.startswith("eval/") and not key.endswith("stderr")),
    ("loss", lambda key: key.startswith("loss/")),
    ("KL", lambda key: key.startswith("kl/")),
    ("response length", lambda key: key in ("response/length_mean", "response/length_max")),
    ("entropy", lambda key: "entropy" in key),
    ("tool use", lambda key: key.startswith("tools/")),
    ("throughput", lambda key: key.startswith("throughput/")),
    ("time per step (s)", lambda key: key.startswith("time/") and key.count("/") == 1 and key != "time/elapsed_s"),
]
"""The panels a reader looks at first, in order: (title, which metric keys it draws). A panel
with no changing series is left out."""


def key_curves(series: Series) -> list[tuple[str, list[str]]]:
    """(panel title, keys) of the key curves this run has: constant series left out."""
    panels = []
    for title, wanted in KEY_CURVES:
        keys: list[str] = []
        for key in sorted(series, key=lambda key: (key.count("/"), key)):  # reward/mean before reward/f/mean
            # a series equal to one already drawn (one reward's mean is the reward's) is drawn once
            if wanted(key) and not is_constant(series[key][1]) and all(series[key] != series[k] for k in keys):
                keys.append(key)
        if keys:
            panels.append((title, keys))
    return panels


def plot_key_curves(series: Series, out_dir: Path) -> Path | None:
    """One figure of the key curves (``key_curves``), several series per panel; None when the run
    has none (a folder with no metrics yet)."""
    panels = key_curves(series)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.1 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            steps, values = series[key]
            ax.plot(steps, values, marker="o" if len(steps) < 12 else None, linewidth=1.2, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path = out_dir / "report_key_curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def metric_groups(series: Series) -> dict[str, list[str]]:
    """The changing metrics by group (the part of the key before '/'), for the report's "All
    metrics" section; constant ones are one line of the report, not a plot."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        if not is_constant(series[key][1]):
            groups[key.split("/")[0] if "/" in key else "other"].append(key)
    return dict(sorted(groups.items()))


def staleness_histogram(series: Series, out_dir: Path) -> Path | None:
    """An asynchronous run's samples by staleness (versions between the weights that sampled
    them and the update that trained them; ``async/staleness_k``, each step's fractions averaged
    over the run, the last bin "k or older"), as one bar chart; None for a synchronous run."""
    keys = sorted((key for key in series if key.startswith("async/staleness_") and key[-1].isdigit()),
                  key=lambda key: int(key.rsplit("_", 1)[1]))  # fmt: skip
    if not keys:
        return None
    shares = [sum(series[key][1]) / max(len(series[key][1]), 1) for key in keys]
    labels = [key.rsplit("_", 1)[1] for key in keys]
    labels[-1] += "+"
    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    ax.bar(labels, shares, color="#4a7ab5")
    ax.set_title("samples by staleness (policy versions), whole run", fontsize=9)
    ax.set_xlabel("staleness", fontsize=8)
    ax.set_ylabel("share of samples", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out_dir / "report_async_staleness_histogram.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def comparison_plot(
    curves: dict[str, list[tuple[float, float]]], path: Path, *, title: str, xlabel: str, ylabel: str
) -> Path:
    """Several ``label: [(x, y), ...]`` curves on one axis (e.g. accuracy of two methods over time)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, points in curves.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", linewidth=1.5, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def rl_panels_plot(
    rl_dir: Path, panels: list[tuple[str, str, str | None]], path: Path, *, greedy_label: str = "greedy (held out)"
) -> Path:
    """One panel per ``(title, sampled key, greedy key or None)`` over an RL run's steps: each
    step's batch metric as a line, the held-out evaluations (``greedy key``) as points on a
    0–1 axis. Steps without the sampled key plot as gaps."""
    records = read_jsonl(Path(rl_dir) / "metrics.jsonl")
    steps = [r for r in records if panels[0][1] in r]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.1 * len(panels), 3.4))
    for ax, (title, sampled, greedy) in zip(axes, panels, strict=True):
        values = [r.get(sampled, math.nan) for r in steps]
        ax.plot([r["step"] for r in steps], values, linewidth=1, label="sampled (batch)")
        if greedy:
            evals = [r for r in records if greedy in r]
            ax.plot([r["step"] for r in evals], [r[greedy] for r in evals], marker="o", label=greedy_label)
            ax.set_ylim(-0.02, 1.02)
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
