"""The end-of-run report: curves from ``metrics.jsonl`` and a table of sample completions.

``report.html`` sits in the run directory beside one PNG per metric group (``loss``,
``reward``, ``eval`` ...), so the page opens offline in any browser and the plots can be
pasted elsewhere. It is rebuilt from the files alone, so it can be regenerated for any run,
finished or killed.
"""

from __future__ import annotations

import html
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt

from posttrain.telemetry.metrics import read_jsonl

log = logging.getLogger(__name__)

SKIP_KEYS = {"step"}


def metric_series(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for every numeric metric, in step order."""
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for record in sorted(records, key=lambda r: r.get("step", 0)):
        for key, value in record.items():
            if key not in SKIP_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                series[key][0].append(int(record.get("step", 0)))
                series[key][1].append(float(value))
    return dict(series)


def plot_groups(series: dict[str, tuple[list[int], list[float]]], out_dir: Path) -> list[Path]:
    """One PNG per group (the part of the key before '/'), one panel per metric."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/")[0] if "/" in key else "other"].append(key)
    written = []
    for group, keys in sorted(groups.items()):
        cols = min(3, len(keys))
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
        for ax, key in zip(axes.flat, keys, strict=False):
            steps, values = series[key]
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, linewidth=1.2)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / f"report_{group.replace(' ', '_')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def staleness_histogram(series: dict[str, tuple[list[int], list[float]]], out_dir: Path) -> Path | None:
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


def write_report(
    run_dir: str | Path,
    *,
    title: str = "posttrain run",
    max_samples: int = 24,
    figures: list[str] = (),
    summary: dict[str, Any] | None = None,
    preformatted: dict[str, str] | None = None,
    links: dict[str, str] | None = None,
) -> Path:
    """Build ``report.html`` (and its PNGs) from the run directory's JSONL files.

    ``figures`` (PNG names in the run directory), ``summary`` (a table of numbers),
    ``preformatted`` (titled blocks of text) and ``links`` (title: relative URL) go first.
    """
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")  # a missing file reads as no records
    samples = read_jsonl(run_dir / "samples.jsonl")[-max_samples:]
    series = metric_series(records)
    images = plot_groups(series, run_dir)
    histogram = staleness_histogram(series, run_dir)
    if histogram is not None:
        images.append(histogram)
    last = {key: values[-1] for key, (_, values) in series.items()}
    extra: list[str] = []
    if links:
        extra.append("<p>" + " · ".join(f"<a href='{html.escape(u)}'>{html.escape(t)}</a>" for t, u in links.items()))
    if summary:
        extra += ["<h2>Summary</h2>", _table([{"item": k, "value": v} for k, v in summary.items()])]
    extra += [f"<p><img src='{html.escape(name)}' alt='{html.escape(name)}'></p>" for name in figures]
    for heading, text in (preformatted or {}).items():
        extra += [f"<h3>{html.escape(heading)}</h3>", f"<pre>{html.escape(text)}</pre>"]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1300px}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:left;vertical-align:top}td.text{font-family:monospace;white-space:pre-wrap}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *extra,
        f"<p>{len(records)} logged steps; run directory <code>{html.escape(str(run_dir))}</code>.</p>",
        "<h2>Final values</h2>",
        _table([{"metric": k, "value": f"{v:.6g}"} for k, v in sorted(last.items())]),
        "<h2>Curves</h2>",
        *[f"<p><img src='{html.escape(p.name)}' alt='{html.escape(p.stem)}'></p>" for p in images],
        f"<h2>Sample completions (last {len(samples)})</h2>",
        _table(samples),
        "</body></html>",
    ]
    path = run_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_failure_report(run_dir: str | Path, *, title: str, error: BaseException) -> Path | None:
    """``report.html`` of a run that stopped: what it logged so far, headed by why it stopped.

    Written on the way out of a failing run, so it must never hide the failure it reports: a
    problem building the report is logged and None returned."""
    if isinstance(error, KeyboardInterrupt):
        reason = "interrupted (Ctrl-C)"
    elif hasattr(error, "signal_name"):  # train/stopping.py's Stopped: a stop asked for, not a failure
        reason = str(error)
    else:
        reason = f"{type(error).__name__}: {error}"
    try:
        return write_report(run_dir, title=f"{title} (stopped)", preformatted={"The run stopped": reason})
    except Exception as report_error:  # the run's own error is the one to raise
        log.warning("could not write the report of the stopped run: %s", report_error)
        return None


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(row.get(c, "")) for c in columns) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"<td>{value:.4g}</td>"
    css = " class='text'" if isinstance(value, str) and len(value) > 12 else ""
    return f"<td{css}>{html.escape(str(value))}</td>"
