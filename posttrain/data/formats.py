"""The row formats users bring, and validation that reports bad rows before training starts.

Formats (detected from the columns, or named):

* ``prompt``: a prompt (+ any columns, passed through to reward functions untouched);
* ``prompt_completion``: prompt + completion (SFT);
* ``preference``: prompt + chosen + rejected (+ optional numeric ``margin``) (reward models, DPO);
* ``conversational``: ``messages``, a list of ``{"role", "content"}``; for SFT the last
  assistant turn is the completion. Preference rows may hold message lists too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.loading import DataError, Row

FORMATS = ("prompt", "prompt_completion", "preference", "conversational")
ROLES = ("system", "user", "assistant", "tool")
REQUIRED = {
    "prompt": ("prompt",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "conversational": ("messages",),
}


@dataclass
class ValidationReport:
    """What validation kept and what it skipped, by reason."""

    kept: list[Row]
    skipped: dict[str, list[int]] = field(default_factory=dict)  # reason → row indices

    def summary(self, total: int) -> str:
        if not self.skipped:
            return f"all {total} rows are valid"
        parts = []
        for reason, rows in sorted(self.skipped.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
            parts.append(f"{len(rows)} {reason} (row{'s' if len(rows) > 1 else ''} {shown})")
        skipped = sum(len(r) for r in self.skipped.values())
        return f"skipped {skipped} of {total} rows: " + "; ".join(parts)


def detect_format(columns: Sequence[str]) -> str:
    """The format a set of columns implies (most specific first)."""
    names = set(columns)
    if {"chosen", "rejected"} <= names:
        return "preference"
    if "messages" in names:
        return "conversational"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "prompt" in names:
        return "prompt"
    raise DataError(
        f"cannot tell the data format from the columns {sorted(names)}; expected 'prompt' (set data.prompt_column "
        "if it is named otherwise), 'prompt'+'completion', 'prompt'+'chosen'+'rejected', or 'messages'"
    )


def validate_rows(
    rows: Sequence[Row],
    *,
    source: str,
    data_format: str | None = None,
    prompt_column: str = "prompt",
    on_bad_row: str = "error",
) -> ValidationReport:
    """Check every row; raise naming the first bad row (``on_bad_row="error"``) or skip bad
    rows and count them by reason (``"skip"``). A file with no valid row is always an error."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if not rows:
        raise DataError(f"{source} holds no rows")
    renamed = [_renamed(row, prompt_column) for row in rows]
    fmt = data_format or detect_format(list(renamed[0]))
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; valid: {', '.join(FORMATS)}")
    kept, skipped = [], defaultdict(list)
    for index, row in enumerate(renamed):
        problem = _problem(row, fmt)
        if problem is None:
            kept.append(row)
        elif on_bad_row == "error":
            field_name, reason = problem
            raise DataError(f"{source}, row {index}, field {field_name!r}: {reason}")
        else:
            skipped[f"{problem[1]} in {problem[0]!r}"].append(index)
    report = ValidationReport(kept, dict(skipped))
    if not kept:
        raise DataError(f"{source}: no valid row; {report.summary(len(rows))}")
    return report


def _renamed(row: Row, prompt_column: str) -> Row:
    if prompt_column == "prompt" or prompt_column not in row:
        return row
    return {("prompt" if k == prompt_column else k): v for k, v in row.items()}


def _problem(row: Row, fmt: str) -> tuple[str, str] | None:
    """(field, reason) of the first problem of a row, or None."""
    for name in REQUIRED[fmt]:
        if name not in row or row[name] is None:
            return name, "missing"
    if fmt == "conversational":
        return _message_problem(row["messages"], "messages", need_assistant=False)
    for name in REQUIRED[fmt]:
        value = row[name]
        if isinstance(value, list):
            problem = _message_problem(value, name, need_assistant=name != "prompt")
            if problem:
                return problem
        elif not isinstance(value, str):
            return name, f"expected text, found {type(value).__name__}"
        elif name != "prompt" and not value.strip():
            return name, "empty"
    if fmt == "preference":
        if row["chosen"] == row["rejected"]:
            return "rejected", "identical to chosen"
        margin = row.get("margin")
        if margin is not None and not isinstance(margin, (int, float)):
            return "margin", f"expected a number, found {type(margin).__name__}"
    return None


def _message_problem(messages: Any, name: str, need_assistant: bool) -> tuple[str, str] | None:
    if not isinstance(messages, list) or not messages:
        return name, "expected a non-empty list of messages"
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            return name, f"message {turn} is not a {{'role', 'content'}} object"
        if message["role"] not in ROLES:
            return name, f"message {turn} has unknown role {message['role']!r} (valid: {', '.join(ROLES)})"
        if not isinstance(message["content"], str):
            return name, f"message {turn} content is {type(message['content']).__name__}, expected text"
    if need_assistant and messages[-1]["role"] != "assistant":
        return name, "the last message must be the assistant's"
    return None
