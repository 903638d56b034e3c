"""The README's table of `examples/smollm2_tool.py`: every stage's figures, time and peak memory,
one column per seed, from each seed's ``summary.json`` (Markdown on stdout).

    .venv/bin/python examples/smollm2_tool_table.py             # runs/smollm2/calculator-*/summary.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def percent(result: dict[str, Any], key: str = "greedy") -> str:
    """``86.7% ± 2.0`` (the standard error in points), or ``—`` when not measured."""
    if result.get(key) is None:
        return "—"
    error = result.get(f"{key}_stderr")
    return f"{100 * result[key]:.1f}%" + (f" ± {100 * error:.1f}" if error else "")


def calls(result: dict[str, Any]) -> str:
    """Episodes with a call / well-formed calls / calls per episode."""
    formed = result.get("well_formed_calls")
    formed_text = "—" if formed is None else f"{100 * formed:.0f}%"
    return f"{100 * result['episodes_with_a_call']:.0f}% / {formed_text} / {result['calls_per_episode']:.2f}"


def cost(summary: dict[str, Any], *stages: str) -> str:
    """The stages' seconds together and the largest peak RSS among them."""
    seconds = sum(summary["stage_s"].get(stage, 0.0) for stage in stages)
    peak = max(summary["stage_peak_rss_gb"].get(stage, 0.0) for stage in stages)
    return f"{seconds / 60:.0f} min, {peak:.1f} GB"


def rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(row label, this seed's cell) for every row of the table."""
    alone, shipped = summary["shipped_without_tools"], summary["shipped"]
    sft, rl, gain = summary["after_sft"], summary["after_rl"], summary["rl_gain"]
    own_gain = f"{100 * gain['gain']:+.1f} pts ({gain['gain_over_stderr']:.1f})"
    return [
        ("shipped, no tools: greedy / mean@4", f"{percent(alone)} / {percent(alone, 'mean@4')}"),
        ("shipped, with the tool: greedy; calls", f"{percent(shipped)}; {calls(shipped)}"),
        ("cold start: greedy / mean@4", f"{percent(sft)} / {percent(sft, 'mean@4')}"),
        ("cold start: episodes with a call / well-formed calls / calls per episode", calls(sft)),
        ("cold start, tools off: greedy", percent(sft["tools_off"])),
        ("cold start, reworded prompt: greedy", percent(sft["reworded"])),
        ("after GRPO: greedy / mean@4", f"{percent(rl)} / {percent(rl, 'mean@4')}"),
        ("after GRPO: episodes with a call / well-formed calls / calls per episode", calls(rl)),
        ("after GRPO, tools off: greedy", percent(rl["tools_off"])),
        ("after GRPO, reworded prompt: greedy", percent(rl["reworded"])),
        ("`final/` through plain transformers: greedy", percent(summary["plain_transformers"])),
        ("GRPO's own gain, greedy (in standard errors)", own_gain),
        ("time, peak RSS: shipped (both)", cost(summary, "shipped_without_tools", "shipped")),
        ("time, peak RSS: cold start (record, SFT, measure)", cost(summary, "cold_start_rows", "sft", "after_sft",
                                                                    "after_sft_tools_off", "after_sft_reworded")),
        ("time, peak RSS: GRPO (40 steps, in-run evaluations)", cost(summary, "rl")),
        ("time, peak RSS: measuring `final/`", cost(summary, "response_template", "trained", "trained_tools_off",
                                                     "trained_reworded", "plain_transformers")),
    ]  # fmt: skip


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """The Markdown table, one column per seed."""
    columns = {seed: dict(rows(summary)) for seed, summary in summaries.items()}
    labels = [label for label, _ in rows(next(iter(summaries.values())))]
    lines = ["| 300 held-out problems | " + " | ".join(f"seed {seed}" for seed in columns) + " |"]
    lines.append("|---|" + "---|" * len(columns))
    lines += [f"| {label} | " + " | ".join(column[label] for column in columns.values()) + " |" for label in labels]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/smollm2"))
    args = parser.parse_args()
    found = sorted(args.output_dir.glob("calculator-*/summary.json"))
    if not found:
        raise SystemExit(f"no calculator-*/summary.json under {args.output_dir}: run examples/smollm2_tool.py first")
    summaries = {path.parent.name.split("-")[-1]: json.loads(path.read_text()) for path in found}
    print(table(summaries))


if __name__ == "__main__":
    main()
