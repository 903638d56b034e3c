"""Small line plots drawn as inline SVG: the report's "All metrics" section, one per changing metric.

A run logs dozens of metrics; drawing each as a matplotlib panel cost ~0.1 s apiece (2.7 s for a
two-step run's 28 changing metrics, most of a short run's wall time). An SVG polyline with its
range written beside it costs microseconds, stays sharp at any zoom and needs no file beside the
page. The key curves a reader looks at first stay a PNG (report_plots.py), to paste elsewhere."""

from __future__ import annotations

import html
import math

from posttrain.telemetry.headline import number

WIDTH, HEIGHT = 280, 130
LEFT, RIGHT, TOP, BOTTOM = 58, 10, 20, 20
"""The plot's size and the margins that hold its title (top), value range (left) and steps (bottom), px."""


def _segments(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The runs of finite points: a NaN or an infinity breaks the line, as in matplotlib."""
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if math.isfinite(y):
            segments[-1].append((x, y))
        elif segments[-1]:
            segments.append([])
    return [segment for segment in segments if segment]


def line_svg(title: str, steps: list[float], values: list[float]) -> str:
    """``values`` over ``steps`` as one SVG line plot titled ``title``: the lowest and highest value at
    the left edge, the first and last step below, a dot per point when there are fewer than 30."""
    finite = [v for v in values if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    first, last = (min(steps), max(steps)) if steps else (0.0, 1.0)
    span_y, span_x = (high - low) or 1.0, (last - first) or 1.0
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        return LEFT + (x - first) / span_x * inner_w, TOP + (high - y) / span_y * inner_h

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' font-family='sans-serif'>",
        f"<text x='{WIDTH / 2}' y='13' font-size='11' text-anchor='middle'>{html.escape(title)}</text>",
        f"<rect x='{LEFT}' y='{TOP}' width='{inner_w}' height='{inner_h}' fill='none' stroke='#ccc'/>",
        *[
            f"<text x='{LEFT - 4}' y='{y}' font-size='9' text-anchor='end'>{html.escape(number(v))}</text>"
            for v, y in ((high, TOP + 8), (low, HEIGHT - BOTTOM))
        ],
        *[
            f"<text x='{x}' y='{HEIGHT - 6}' font-size='9' text-anchor='{anchor}'>step {number(step)}</text>"
            for step, x, anchor in ((first, LEFT, "start"), (last, WIDTH - RIGHT, "end"))
        ],
    ]
    points = list(zip(steps, values, strict=True))
    for segment in _segments(points):
        drawn = [at(x, y) for x, y in segment]
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in drawn)
        parts.append(f"<polyline points='{line}' fill='none' stroke='#1f77b4' stroke-width='1.3'/>")
        if len(points) < 30:
            parts += [f"<circle cx='{x:.1f}' cy='{y:.1f}' r='1.8' fill='#1f77b4'/>" for x, y in drawn]
    return "".join(parts) + "</svg>"
