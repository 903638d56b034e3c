"""The row formats users bring, and validation that reports bad rows before training starts.

Formats (detected from the columns, or named with ``data_format``):

* ``prompt``: a prompt, for online RL; every other column is passed through untouched to
  the reward functions;
* ``prompt_completion``: prompt + completion (SFT);
* ``preference``: prompt + chosen + rejected, optional numeric ``margin`` (reward models, DPO);
  conversational pairs may leave the prompt out and give each side whole (TRL's implicit
  prompt): the prompt is then the messages both sides open with, split off at load time;
* ``conversational``: ``messages``, a list of ``{"role", "content"}`` ending with the
  assistant's turn, which SFT learns.

Prompts, completions, chosen and rejected may each be text or a list of messages (TRL's
conversational form: the prompt holds the turns so far, the response the assistant's turn,
starting with it), but one row does not mix the two.

Covers: missing columns, wrong types, malformed messages, unknown roles, empty responses
(and empty prompts of prompt-only rows, which RL samples from), identical chosen/rejected,
non-numeric margins. Does not cover: whether the text suits the tokenizer or fits the context
length (the trainer checks those where it tokenizes).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.loading import DataError, Row, Rows

FORMATS = ("prompt", "prompt_completion", "preference", "conversational", "episode")
ROLES = ("system", "user", "assistant", "tool")
REQUIRED = {
    "prompt": ("prompt",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "conversational": ("messages",),
    "episode": (),  # any columns: the whole row goes to an environment's reset (never detected, only named)
}
RESPONSES = ("completion", "chosen", "rejected")  # must hold text a model can be trained on
_SHOWN_ROWS = 5  # row indices listed per reason in a skip summary


@dataclass(frozen=True)
class Problem:
    """What is wrong with one row: the field, a short label to count by, and the details."""

    field: str
    label: str  # reads with the field name in place of {field}: "empty {field}"
    detail: str


@dataclass
class ValidationReport:
    """The rows validation kept, the format they were read as, and what it skipped, by reason."""

    kept: Rows  # in file order, each knowing its row (and line) in the file
    data_format: str
    total: int
    skipped: dict[str, list[int]] = field(default_factory=dict)  # reason → row indices

    def summary(self) -> str:
        """One line a person can act on:
        ``skipped 3 of 200 rows: 2 empty 'completion' (rows 4, 17); 1 missing 'prompt' (row 9)``."""
        if not self.skipped:
            return f"all {self.total} rows are valid"
        parts = []
        for reason, rows in sorted(self.skipped.items(), key=lambda item: (-len(item[1]), item[0])):
            shown = ", ".join(map(str, rows[:_SHOWN_ROWS])) + (", ..." if len(rows) > _SHOWN_ROWS else "")
            parts.append(f"{len(rows)} {reason} (row{'s' if len(rows) > 1 else ''} {shown})")
        count = sum(len(rows) for rows in self.skipped.values())
        return f"skipped {count} of {self.total} rows: " + "; ".join(parts)


def detect_format(columns: Sequence[str]) -> str:
    """The format a set of columns implies (most specific first)."""
    format_ = _format_of(columns)
    if format_ is None:
        raise DataError(
            f"cannot tell the data format from the columns {sorted(columns)}; expected 'prompt' (set "
            "data.prompt_column if it is named otherwise), 'prompt'+'completion', 'prompt'+'chosen'+'rejected', "
            "or 'messages'"
        )
    return format_


def infer_format(rows: Sequence[Row], prompt_column: str = "prompt") -> str:
    """The format most rows' columns imply (`prompt_column` counts as ``prompt``).

    A vote rather than the first row's columns, so that one row missing its completion is
    reported as such instead of turning the whole file into prompt-only data.
    """
    votes = Counter(_format_of(_canonical(row, prompt_column)) for row in rows)
    del votes[None]
    if not votes:
        return detect_format(_canonical(rows[0], prompt_column) if rows else [])
    most = max(votes.values())
    return next(format_ for format_ in FORMATS[::-1] if votes[format_] == most)  # ties: most specific


def validate_rows(
    rows: Sequence[Row],
    *,
    source: str,
    data_format: str | None = None,
    prompt_column: str = "prompt",
    on_bad_row: str = "error",
    allowed_formats: Sequence[str] | None = None,
) -> ValidationReport:
    """Check every row before training; the kept rows have `prompt_column` renamed ``prompt``.

    ``on_bad_row="error"`` raises at the first bad row, naming `source`, the row (counted
    from 0, as in ``dataset[i]``; with its line for JSON Lines) and the field. ``"skip"``
    drops bad rows and counts them by reason (:meth:`ValidationReport.summary`). A source
    with no valid row is an error either way. `allowed_formats` lists the formats the caller
    can train on (an SFT run cannot use prompt-only rows), so a mismatch fails here, not in
    the middle of a run.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if not rows:
        raise DataError(f"{source} holds no rows")
    _check_prompt_column(rows, prompt_column, source)
    format_ = data_format or infer_format(rows, prompt_column)
    if format_ not in FORMATS:
        raise DataError(f"unknown data format {format_!r}; valid: {', '.join(FORMATS)}")
    if allowed_formats is not None and format_ not in allowed_formats:
        needed = " or ".join(map(repr, allowed_formats))
        raise DataError(
            f"{source}: rows are in the {format_!r} format, but this run needs {needed} (columns: {_keys(rows[0])})"
        )
    where = rows.where if isinstance(rows, Rows) else (lambda index: f"row {index}")
    kept, kept_at, skipped = [], [], defaultdict(list)
    for index, row in enumerate(rows):
        problem = check_row(row, format_, prompt_column)
        if problem is None:
            kept.append(_with_prompt(_renamed(row, prompt_column)))
            kept_at.append(index)
        elif on_bad_row == "error":
            raise DataError(f"{source}, {where(index)}, field {problem.field!r}: {problem.detail}")
        else:
            skipped[problem.label.format(field=repr(problem.field))].append(index)
    # the kept rows remember their place in the file, for errors found later (tokenizing)
    lines = rows.line_numbers if isinstance(rows, Rows) else None
    indices = rows.indices if isinstance(rows, Rows) else None
    kept_rows = Rows(
        kept,
        None if lines is None else [lines[i] for i in kept_at],
        kept_at if indices is None else [indices[i] for i in kept_at],
    )
    report = ValidationReport(kept_rows, format_, len(rows), dict(skipped))
    if not kept:
        raise DataError(f"{source}: no valid row; {report.summary()}")
    return report


# reward functions receive the batch's own under these names (TRL's): a column so named would vanish
BATCH_ARGUMENTS = ("prompts", "completions", "completion_ids")


def check_row(row: Mapping[str, Any], data_format: str, prompt_column: str = "prompt") -> Problem | None:
    """The first problem of a row read as `data_format`, or None when it is valid."""
    if data_format in ("prompt", "episode"):
        taken = [name for name in BATCH_ARGUMENTS if name in row]
        if taken:
            return Problem(
                taken[0],
                "column named {field}",
                f"a column named {taken[0]!r}: reward functions receive the batch's prompts, completions and "
                f"completion_ids under these names, so it would be hidden; rename it (e.g. reference_{taken[0]})",
            )
    if data_format == "episode":
        return None if row else Problem("(row)", "empty row", "an empty row; an episode starts from its columns")
    if data_format == "preference" and _implicit_prompt(row, prompt_column):
        return _implicit_prompt_problem(row)
    columns = {name: prompt_column if name == "prompt" else name for name in REQUIRED[data_format]}
    for column in columns.values():
        if row.get(column) is None:
            needed = ", ".join(columns.values())
            return Problem(
                column, "missing {field}", f"missing; {data_format} rows need {needed} (row has: {_keys(row)})"
            )
    for name, column in columns.items():
        problem = _value_problem(name, column, row[column])
        if problem is not None:
            return problem
    if data_format == "prompt" and _blank(row[columns["prompt"]]):
        # RL samples a completion of it: an empty prompt conditions on nothing but BOS
        return Problem(columns["prompt"], "empty {field}", "empty prompt; RL needs a prompt to sample a completion of")
    if data_format == "conversational":
        return _conversation_problem(row)
    return _pair_problem(row, data_format, columns)


def _blank(value: str | list[Mapping[str, Any]]) -> bool:
    """Text, or every message's content, is whitespace only."""
    if isinstance(value, str):
        return not value.strip()
    return all(not message["content"].strip() for message in value)


def _value_problem(name: str, column: str, value: Any) -> Problem | None:
    """`name` is the field's role (prompt, completion, ...), `column` what the data calls it."""
    if isinstance(value, list):
        return _messages_problem(name, column, value)
    if name == "messages":
        return Problem(column, "malformed {field}", f"expected a list of messages, found {type(value).__name__}")
    if not isinstance(value, str):
        found = f"{type(value).__name__} {_short(value)}"
        return Problem(column, "non-text {field}", f"expected text or a list of messages, found {found}")
    if name in RESPONSES and not value.strip():
        return Problem(column, "empty {field}", "empty text; a response to train on needs at least one character")
    return None


def _messages_problem(name: str, column: str, messages: list[Any]) -> Problem | None:
    """Messages must be ``{"role", "content"}`` objects with a known role and text content; a
    response's (and a ``messages`` conversation's) last turn is the assistant's, non-empty."""
    if not messages:
        return Problem(column, "empty {field}", "an empty list of messages")
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            found = _keys(message) if isinstance(message, Mapping) else type(message).__name__
            return Problem(column, "malformed {field}", f"message {turn} is not a {{role, content}} object ({found})")
        if message["role"] not in ROLES:
            role = message["role"]
            detail = f"message {turn} has unknown role {role!r}; valid: {', '.join(ROLES)}"
            return Problem(column, "unknown role in {field}", detail)
        calls = message.get("tool_calls")
        if calls is not None:  # OpenAI's and TRL's form of a call turn: the calls beside (or instead of) text
            problem = _tool_calls_problem(column, turn, message)
            if problem is not None:
                return problem
            if message["content"] is None:
                continue
        if not isinstance(message["content"], str):
            content = f"{type(message['content']).__name__} {_short(message['content'])}"
            return Problem(column, "non-text {field}", f"message {turn} content is {content}, expected text")
    if name in RESPONSES and messages[0]["role"] != "assistant":
        detail = (
            f"message 0 is {messages[0]['role']!r}'s; a response starts with the assistant's turn "
            "(the turns before it belong in the prompt)"
        )
        return Problem(column, "response not opened by the assistant in {field}", detail)
    if name in (*RESPONSES, "messages"):
        last = messages[-1]
        if last["role"] != "assistant":
            detail = f"the last message is {last['role']!r}'s; it must be the assistant's"
            return Problem(column, "no assistant turn in {field}", detail)
        if not (last["content"] or "").strip() and not last.get("tool_calls"):
            return Problem(column, "empty {field}", "the assistant's message is empty")
    return None


def _tool_calls_problem(column: str, turn: int, message: Mapping[str, Any]) -> Problem | None:
    """``tool_calls`` on an assistant message: a list of ``{function: {name, arguments}}``, the
    arguments an object or a JSON string of one."""
    calls, label = message["tool_calls"], "malformed tool_calls in {field}"
    shape = "a list of {type: function, function: {name, arguments}}"
    if message["role"] != "assistant" or not isinstance(calls, list):
        return Problem(column, label, f"message {turn}: tool_calls is {shape}, on an assistant message")
    for index, call in enumerate(calls):
        if not _is_call(call):
            detail = f"message {turn}, call {index} is {_short(call)}; tool_calls is {shape} (arguments an object)"
            return Problem(column, label, detail)
    return None


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return False
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return False
    return isinstance(arguments, dict)


def _conversation_problem(row: Mapping[str, Any]) -> Problem | None:
    """A conversation trains its assistant turns, each answering what came before it: it opens with
    the user (or a system message), two assistant turns never follow each other, and ``tools``
    (when given) is a list of the function schemas a chat template lists."""
    roles = [message["role"] for message in row["messages"]]
    opening = next((role for role in roles if role != "system"), None)
    if opening == "assistant":
        detail = "the conversation opens with the assistant's turn; it starts with the user's (after a system message)"
        return Problem("messages", "conversation opened by the assistant in {field}", detail)
    twice = next((i for i in range(1, len(roles)) if roles[i] == roles[i - 1] == "assistant"), None)
    if twice is not None:
        detail = f"messages {twice - 1} and {twice} are both the assistant's; merge them, or put the turn between"
        return Problem("messages", "two assistant turns in a row in {field}", detail)
    orphan = next(
        (i for i in range(len(roles)) if roles[i] == "tool" and (i == 0 or roles[i - 1] not in ("assistant", "tool"))),
        None,
    )
    if orphan is not None:
        detail = f"message {orphan} is a tool's result answering no call: it follows the assistant's turn that called"
        return Problem("messages", "tool result answering no call in {field}", detail)
    tools = row.get("tools")
    if tools is None:
        return None
    schema = "{type: function, function: {name, description, parameters}}"
    if not isinstance(tools, list):
        return Problem("tools", "malformed {field}", f"{_short(tools)} is not a list of schemas, each {schema}")
    for index, tool in enumerate(tools):
        if not _is_tool_schema(tool):
            detail = f"entry {index} is {_short(tool)}, not a function schema {schema}"
            return Problem("tools", "malformed {field}", detail)
    return None


def _is_tool_schema(tool: Any) -> bool:
    """A function schema as chat templates read it (TRL's and transformers' form), or its inner part."""
    function = tool.get("function", tool) if isinstance(tool, Mapping) else None
    return isinstance(function, Mapping) and isinstance(function.get("name"), str) and bool(function["name"])


def _pair_problem(row: Mapping[str, Any], data_format: str, columns: Mapping[str, str]) -> Problem | None:
    """Checks across fields: text and messages not mixed, two different responses, a margin."""
    used = [column for name, column in columns.items() if name != "messages"]
    is_messages = {column: isinstance(row[column], list) for column in used}
    odd = next((column for column in used[1:] if is_messages[column] != is_messages[used[0]]), None)
    if odd is not None:
        this, first = ("messages", "text") if is_messages[odd] else ("text", "messages")
        return Problem(odd, "text and messages mixed in {field}", f"is {this} but {used[0]!r} is {first}; use one form")
    if data_format != "preference":
        return None
    if row["chosen"] == row["rejected"]:
        return Problem("rejected", "{field} identical to 'chosen'", "identical to 'chosen'; a pair needs two responses")
    margin = row.get("margin")
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)
    ):
        found = f"{type(margin).__name__} {_short(margin)}"
        return Problem("margin", "bad {field}", f"expected a finite number, found {found}")
    return None


def _implicit_prompt(row: Mapping[str, Any], prompt_column: str) -> bool:
    """A conversational pair without a prompt: each side is the whole conversation."""
    return row.get(prompt_column) is None and all(isinstance(row.get(side), list) for side in ("chosen", "rejected"))


def _shared_turns(chosen: list[Any], rejected: list[Any]) -> int:
    """How many opening messages the two sides share (TRL's ``extract_prompt``)."""
    count = 0
    while count < min(len(chosen), len(rejected)) and chosen[count] == rejected[count]:
        count += 1
    return count


def _implicit_prompt_problem(row: Mapping[str, Any]) -> Problem | None:
    """Each side must be a valid conversation; they share the prompt and differ after it."""
    for side in ("chosen", "rejected"):
        problem = _messages_problem("messages", side, row[side])
        if problem is not None:
            return problem
    if _shared_turns(row["chosen"], row["rejected"]) == 0:
        detail = (
            "'chosen' and 'rejected' share no opening message; without a 'prompt' column the prompt is the "
            "messages both conversations start with (or give 'prompt' separately)"
        )
        return Problem("chosen", "no shared prompt in {field}", detail)
    split = _with_prompt(row)
    for side in ("chosen", "rejected"):
        if not split[side]:
            other = "rejected" if side == "chosen" else "chosen"
            detail = f"holds nothing after the messages it shares with {other!r}; a pair needs two replies"
            return Problem(side, "no reply in {field}", detail)
    return check_row(split, "preference")


def _with_prompt(row: Row) -> Row:
    """A pair with an implicit prompt split into prompt, chosen and rejected; others unchanged."""
    if not _implicit_prompt(row, "prompt"):
        return row
    shared = _shared_turns(row["chosen"], row["rejected"])
    return {
        **row,
        "prompt": row["chosen"][:shared],
        "chosen": row["chosen"][shared:],
        "rejected": row["rejected"][shared:],
    }


def _check_prompt_column(rows: Sequence[Row], prompt_column: str, source: str) -> None:
    """A renamed prompt column must not collide with a column already called ``prompt``."""
    if prompt_column == "prompt":
        return
    for index, row in enumerate(rows):
        if prompt_column in row and "prompt" in row:
            raise DataError(
                f"{source}, row {index}: has both {prompt_column!r} (data.prompt_column) and 'prompt'; "
                "rename or drop one of them"
            )


def _renamed(row: Row, prompt_column: str) -> Row:
    """`row` with `prompt_column` renamed ``prompt``; the row itself when there is nothing to rename."""
    if prompt_column == "prompt" or prompt_column not in row:
        return row
    return {("prompt" if key == prompt_column else key): value for key, value in row.items()}


def _canonical(row: Mapping[str, Any], prompt_column: str) -> list[str]:
    return ["prompt" if key == prompt_column else key for key in row]


def _format_of(columns: Sequence[str]) -> str | None:
    names = set(columns)
    if {"chosen", "rejected"} <= names:
        return "preference"
    if "messages" in names:
        return "conversational"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "prompt" in names:
        return "prompt"
    return None


def _keys(row: Mapping[str, Any]) -> str:
    return ", ".join(map(str, row)) or "no columns"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
