"""What a tool-call format reads a policy turn into: the calls (:class:`ToolCall`), the turn's
status (:class:`ParsedTurn`), the registry the formats are named in, and the JSON helpers every
format decodes a call with (``tool_families.py`` holds the formats, ``tool_formats.py`` chooses one)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.algos.registry import Registry

Status = Literal["parsed", "malformed", "no_call"]


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name, its arguments (a JSON object) and the id the model gave it."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    """A policy turn read by a format: ``calls`` in the order written, ``content`` the text outside
    them (the final answer when there is no call), ``status`` and, when malformed, ``error``."""

    status: Status
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    error: str | None = None


TOOL_FORMATS = Registry("tool call format")
"""Formats by name: classes with ``parse(text) -> ParsedTurn`` and ``render(calls) -> str``."""


def call_from(payload: Any, arguments_key: str) -> ToolCall:
    """A call from its decoded JSON object; ValueError naming what is wrong."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        raise ValueError(f"a call is a JSON object with a 'name' string, got {json.dumps(payload)[:120]}")
    arguments = payload.get(arguments_key, payload.get("arguments", payload.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"the arguments of {payload['name']!r} are not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {payload['name']!r} are not a JSON object: {json.dumps(arguments)[:120]}")
    call_id = payload.get("id")
    return ToolCall(payload["name"], arguments, call_id if isinstance(call_id, str) else None)


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {text.strip()[:120]!r}") from None


def json_at(text: str) -> tuple[Any, int]:
    try:
        return json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {text[:120]!r}") from None
