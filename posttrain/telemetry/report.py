"""The end-of-run report, headline first: ``report.html`` in the run directory.

A reader opens it to learn whether the run worked, so the page goes from the answer to the
detail: what stopped the run and the warnings it printed; a summary (held-out evaluation first
→ last, reward, KL, time); the key curves (report_plots.py); the best, worst and median
completions of the last step; the held-out answers marked right or wrong; and, folded away,
every metric (constant ones as one line). A section with nothing to show is left out.

The page is rebuilt from the run directory's files alone (``metrics.jsonl``, ``samples.jsonl``,
``eval_samples.jsonl``, ``warnings.jsonl`` and ``report.json``, which keeps what a caller added:
a summary, figures, text, links), so ``posttrain report RUN_DIR`` redraws it for any run,
finished or killed.
"""

from __future__ import annotations

import html
import json
import logging
import math
from pathlib import Path
from typing import Any

from posttrain.telemetry.headline import metric_series, run_headline
from posttrain.telemetry.headline import number as _number
from posttrain.telemetry.metrics import read_jsonl
from posttrain.telemetry.report_plots import (
    comparison_plot,
    is_constant,
    key_curves,
    metric_groups,
    plot_key_curves,
    rl_panels_plot,
    staleness_histogram,
)
from posttrain.telemetry.svg_plots import line_svg

__all__ = ["comparison_plot", "rebuild_report", "rl_panels_plot", "write_failure_report", "write_report"]

log = logging.getLogger(__name__)

REPORT_INPUTS = "report.json"
"""What the caller of :func:`write_report` added to the page, kept for :func:`rebuild_report`."""
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1300px}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
    "text-align:left;vertical-align:top}td.text{font-family:monospace;white-space:pre-wrap}"
    ".stopped{border-left:4px solid #b33;padding-left:1em}.warnings li{color:#8a5a00}"
    ".plots{display:flex;flex-wrap:wrap;gap:6px}tr.right td.mark{color:#186a18}tr.wrong td.mark{color:#b33}"
)
ONLY_WRONG = (
    "<script>document.getElementById('only-wrong').addEventListener('change',function(event){"
    "document.querySelectorAll('tr.right').forEach(function(row){row.hidden=event.target.checked;});});</script>"
)


def write_report(
    run_dir: str | Path,
    *,
    title: str = "posttrain run",
    figures: list[str] = (),
    summary: dict[str, Any] | None = None,
    preformatted: dict[str, str] | None = None,
    links: dict[str, str] | None = None,
    stopped: str | None = None,
) -> Path:
    """Build ``report.html`` (and its PNGs) from the run directory's files.

    ``summary`` (numbers that head the summary table), ``figures`` (PNG names in the run
    directory, shown before the key curves), ``preformatted`` (titled blocks of text),
    ``links`` (title: relative URL, e.g. the other reports of a pipeline) and ``stopped`` (why the
    run ended early) are the caller's; they are kept in ``report.json`` for :func:`rebuild_report`.
    """
    run_dir = Path(run_dir)
    inputs = {"title": title, "figures": list(figures), "summary": summary, "preformatted": preformatted}
    inputs |= {"links": links, "stopped": stopped}
    (run_dir / REPORT_INPUTS).write_text(json.dumps(inputs, indent=1, default=str) + "\n", encoding="utf-8")
    records = read_jsonl(run_dir / "metrics.jsonl")  # a missing file reads as no records
    series = metric_series(records)
    if (run_dir / "rollouts.html").is_file():  # posttrain view's page over the recorded rollouts
        links = {**(links or {}), "every recorded rollout, token by token": "rollouts.html"}
    sections = [
        _links(links),
        _stopped(stopped),
        _alarm(run_dir),
        _warnings(read_jsonl(run_dir / "warnings.jsonl")),
        _summary(summary, records, series, run_dir),
        *[f"<p><img src='{html.escape(name)}' alt='{html.escape(name)}'></p>" for name in figures],
        _key_curves(series, run_dir),
        _last_step_samples(read_jsonl(run_dir / "samples.jsonl")),
        _held_out_answers(read_jsonl(run_dir / "eval_samples.jsonl")),
        *[f"<h2>{html.escape(h)}</h2><pre>{html.escape(text)}</pre>" for h, text in (preformatted or {}).items()],
        _all_metrics(series, run_dir),
    ]
    page = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *[section for section in sections if section],
        "</body></html>",
    ]
    path = run_dir / "report.html"
    path.write_text("\n".join(page), encoding="utf-8")
    return path


def rebuild_report(run_dir: str | Path) -> Path:
    """``report.html`` of ``run_dir`` drawn again from its files (``posttrain report RUN_DIR``), with
    what its writer added (``report.json``); a folder without one gets the plain report."""
    run_dir = Path(run_dir)
    inputs_path = run_dir / REPORT_INPUTS
    inputs = json.loads(inputs_path.read_text(encoding="utf-8")) if inputs_path.is_file() else {}
    inputs.setdefault("title", f"posttrain run: {run_dir.resolve().name}")
    inputs = {key: value for key, value in inputs.items() if value is not None}
    return write_report(run_dir, **inputs)


def write_failure_report(run_dir: str | Path, *, title: str, error: BaseException) -> Path | None:
    """``report.html`` of a run that stopped: what it logged so far, headed by why it stopped.

    Written on the way out of a failing run, so it must never hide the failure it reports: a
    problem building the report is logged and None returned."""
    if isinstance(error, KeyboardInterrupt):
        reason = "interrupted (Ctrl-C)"
    elif hasattr(error, "signal_name"):  # run/stopping.py's Stopped: a stop asked for, not a failure
        reason = str(error)
    else:
        reason = f"{type(error).__name__}: {error}"
    try:
        return write_report(run_dir, title=f"{title} (stopped)", stopped=reason)
    except Exception as report_error:  # the run's own error is the one to raise
        log.warning("could not write the report of the stopped run: %s", report_error)
        return None


# ---------------------------------------------------------------------------------- sections
def _links(links: dict[str, str] | None) -> str:
    if not links:
        return ""
    anchors = [f"<a href='{html.escape(url)}'>{html.escape(text)}</a>" for text, url in links.items()]
    return "<p>See also: " + " · ".join(anchors) + "</p>"


def _stopped(reason: str | None) -> str:
    if not reason:
        return ""
    return f"<div class='stopped'><h2>The run stopped</h2><pre>{html.escape(reason)}</pre></div>"


def read_alarm(run_dir: Path) -> dict[str, Any] | None:
    """The reward-hacking alarm's record (``alarm.json``, rewards/hacking_alarm.py), when it fired."""
    path = run_dir / "alarm.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None
    return record if _is_alarm(record) else None


def _is_alarm(record: Any) -> bool:
    """Whether ``record`` has the shape the alarm writes (``hacking_alarm.py``): a run folder is
    anyone's, and the report and the viewer format these values as numbers and step ranges."""

    def numbers(part: Any, *keys: str) -> bool:
        return isinstance(part, dict) and all(_is_number(part.get(key)) for key in keys)

    def step_range(value: Any) -> bool:
        return isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value)

    if not isinstance(record, dict) or not _is_number(record.get("step")):
        return False
    monitor, steps, samples = record.get("monitor"), record.get("steps"), record.get("samples", [])
    return (
        numbers(monitor, "before", "after")
        and isinstance(monitor.get("name"), str)
        and numbers(record.get("optimised"), "before", "after")
        and isinstance(steps, dict)
        and step_range(steps.get("before"))
        and step_range(steps.get("after"))
        and isinstance(samples, list)
        and all(isinstance(sample, dict) for sample in samples)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _alarm(run_dir: Path) -> str:
    """The alarm's evidence as the report's section, when it fired."""
    record = read_alarm(run_dir)
    if record is None:
        return ""
    monitor, steps, optimised = record["monitor"], record.get("steps", {}), record.get("optimised", {})
    name = monitor.get("name", "monitor")
    before, after = steps.get("before", ["?", "?"]), steps.get("after", ["?", "?"])
    text = (
        f"At step {record.get('step')} the optimised reward had risen from {optimised.get('before', 0):.4g} "
        f"(steps {before[0]}–{before[1]}) to {optimised.get('after', 0):.4g} (steps {after[0]}–{after[1]}) while "
        f"the monitor '{name}' (weight 0, not optimised) fell from {monitor.get('before', 0):.4g} to "
        f"{monitor.get('after', 0):.4g}. The samples the reward paid most for against the monitor:"
    )
    rows = [{"score": s.get("score"), name: s.get("monitor"), "completion": s.get("completion")}
            for s in record.get("samples", [])]  # fmt: skip
    return (
        "<div class='stopped'><h2>Reward-hacking alarm</h2>"
        f"<p>{html.escape(text)}</p>{_table(rows) if rows else ''}</div>"
    )


def _warnings(records: list[dict[str, Any]]) -> str:
    """The warnings the run printed (``warnings.jsonl``), each once, in the order they came."""
    if not records:
        return ""
    items = [f"<li>step {r.get('step', '?')}: {html.escape(str(r.get('message', '')))}</li>" for r in records]
    return f"<h2>Warnings ({len(records)})</h2><ul class='warnings'>{''.join(items)}</ul>"


def _summary(given: dict[str, Any] | None, records: list[dict], series: dict, run_dir: Path) -> str:
    rows = {key: value for key, value in (given or {}).items() if value is not None}
    rows |= run_headline(records, series)
    if not rows:
        return ""
    rows["run directory"] = str(run_dir)
    lines = [
        f"<tr><th>{html.escape(key)}</th><td>{html.escape(str(_plain(value)))}</td></tr>" for key, value in rows.items()
    ]
    return "<h2>Summary</h2><table class='summary'>" + "".join(lines) + "</table>"


def _key_curves(series: dict, run_dir: Path) -> str:
    path = plot_key_curves(series, run_dir)
    if path is None:
        return ""
    panels = ", ".join(title for title, _ in key_curves(series))
    return f"<h2>Key curves</h2><p><img src='{path.name}' alt='key curves'></p><p class='panels'>Panels: {panels}.</p>"


def _last_step_samples(samples: list[dict[str, Any]]) -> str:
    """The best, the worst and the median completion (by reward) of the last step logged."""
    if not samples:
        return ""
    last = max(int(s.get("step", 0)) for s in samples)
    scored = sorted(
        (s for s in samples if int(s.get("step", 0)) == last),
        key=lambda s: -math.inf if s.get("reward") is None else float(s["reward"]),
    )
    picks = {"best": scored[-1], "median": scored[len(scored) // 2], "worst": scored[0]}
    rows = [{"": which, **{k: v for k, v in s.items() if k != "step"}} for which, s in picks.items()]
    return f"<h2>Completions of step {last}: best, median, worst</h2>" + _table(rows)


def _held_out_answers(samples: list[dict[str, Any]]) -> str:
    """The last evaluation's answers, each marked right (full marks), wrong, or unscored."""
    if not samples:
        return ""
    last = max(int(s.get("step", 0)) for s in samples)
    rows = [s for s in samples if int(s.get("step", 0)) == last]
    right = sum(1 for s in rows if s.get("correct") is True)
    head = f"<h2>Held-out answers at step {last}: {right} of {len(rows)} right</h2>"
    toggle = "<p><label><input type='checkbox' id='only-wrong'> only the answers that are not right</label></p>"
    columns = ["prompt", "completion", "reward"]
    body = []
    for sample in rows:
        correct = sample.get("correct")
        css, mark = {True: ("right", "✓ right"), False: ("wrong", "✗ wrong")}.get(correct, ("wrong", "unscored"))
        cells = "".join(_cell(sample.get(column, "")) for column in columns)
        body.append(f"<tr class='{css}'><td class='mark'>{mark}</td>{cells}</tr>")
    table = "<table><tr><th></th>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>" + "".join(body) + "</table>"
    return head + toggle + table + ONLY_WRONG


def _all_metrics(series: dict, run_dir: Path) -> str:
    """Every metric, folded away: constant ones on one line, the final values, then a plot of each
    changing one (inline SVG), grouped by the part of its key before '/'."""
    if not series:
        return ""
    constant = [f"{key} = {_number(values[-1])}" for key, (_, values) in sorted(series.items()) if is_constant(values)]
    finals = [{"metric": key, "last value": _number(values[-1])} for key, (_, values) in sorted(series.items())]
    parts = ["<details><summary><b>All metrics</b> (final values and a plot of each changing one)</summary>"]
    if constant:
        parts.append(f"<p>Constant throughout: {html.escape(', '.join(constant))}.</p>")
    parts.append(_table(finals))
    for group, keys in metric_groups(series).items():
        plots = "".join(line_svg(key, *series[key]) for key in keys)
        parts.append(f"<h3>{html.escape(group)}</h3><div class='plots'>{plots}</div>")
    histogram = staleness_histogram(series, run_dir)
    if histogram is not None:
        parts.append(f"<p><img src='{histogram.name}' alt='{html.escape(histogram.stem)}'></p>")
    return "".join(parts) + "</details>"


# ---------------------------------------------------------------------------------- cells
def _plain(value: Any) -> Any:
    return _number(value) if isinstance(value, float) else value


def _table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(row.get(c, "")) for c in columns) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def conversation_text(value: Any) -> Any:
    """A conversation (chat messages) as a reader follows it, a turn a line: ``[role] content``
    (a tool turn names its tool); anything else unchanged."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return "\n".join(
            f"[{m['role']}{' ' + m['name'] if m.get('name') else ''}] {m.get('content', '')}" for m in value
        )
    return value


def _cell(value: Any) -> str:
    value = conversation_text(value)
    if isinstance(value, float):
        return f"<td>{value:.4g}</td>"
    css = " class='text'" if isinstance(value, str) and len(value) > 12 else ""
    return f"<td{css}>{html.escape(str(value))}</td>"
