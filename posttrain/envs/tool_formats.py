"""Tool calls as each model family writes them, parsed from a policy turn and written back.

A model calls tools in the format its chat template taught it; a parser that disagrees with the
template loses calls without a word (the first of two parallel calls parsed, a call cut by
``max_new_tokens`` read as a final answer). So each format here parses a turn into a
:class:`ParsedTurn` whose ``status`` says what happened — ``parsed``, ``malformed`` (with why) or
``no_call`` — and renders calls back into the family's text (tests, recorded SFT data):

* ``hermes`` — Hermes 2 Pro, Qwen2.5, Qwen3, SmolLM3: one block per call,
  ``<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>``;
* ``smollm2`` — SmolLM2: one block holding a JSON list of calls,
  ``<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>``;
* ``llama3_json`` — Llama 3.1–3.3 JSON tool calling: the turn is the call,
  ``{"name": "add", "parameters": {"a": 1}}`` (an ``<|python_tag|>`` before it is allowed;
  parallel calls separated by ``;``);
* ``pythonic`` — Llama 3.2 and 4: a Python list of calls, ``[add(a=1, b=2)]``;
* ``mistral`` — ``[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "a1b2c3d4e"}]``
  (tokenizer v3, v7), or ``[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}`` per call (v11);
* ``deepseek_v3`` — ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add``, the
  arguments in a ```` ```json ```` block, ``<｜tool▁call▁end｜>`` per call, ``<｜tool▁calls▁end｜>``.

Each family's rules and their sources are in ``tool_families.py``. A turn is read as the episode
decodes it, the format's markers kept where they are special tokens (``turn_text.py``).

``detect_format(chat_template)`` picks one from the markers a template contains (``auto``).
A tokenizer that ships a *response template* (transformers ≥ 5.13: ``tokenizer.response_template``,
read by ``tokenizer.parse_response``) is parsed by it instead (:class:`ResponseTemplateFormat`),
and so is a response template given as a JSON file (``format: my_template.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import posttrain.envs.tool_families  # noqa: F401  (registers the formats)
from posttrain.envs.tool_calls import TOOL_FORMATS, ParsedTurn, ToolCall, call_from
from posttrain.errors import PosttrainError

__all__ = [
    "MARKERS",
    "TOOL_FORMATS",
    "ParsedTurn",
    "ToolCall",
    "ToolFormatError",
    "detect_format",
    "parse_turn",
    "resolve_format",
    "tokenizer_format",
]


class ToolFormatError(PosttrainError, ValueError):
    """A format cannot be chosen (``env.options.format``, or ``auto`` on a template without markers)."""


def parse_turn(tool_format: Any, text: str) -> ParsedTurn:
    """``tool_format.parse(text)``; a call whose JSON nests past the interpreter's stack (thousands of
    levels of arrays) is the policy's malformed call, answered and counted, not an environment failure."""
    try:
        turn = tool_format.parse(text)
    except RecursionError:
        return ParsedTurn("malformed", content=text, error="the call's JSON nests thousands of levels deep")
    if turn.status == "parsed" and not turn.calls:  # a call turn is never answered with nothing
        return ParsedTurn("malformed", content=text, error="a tool-call turn without a call")
    return turn


MARKERS = [
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<|python_tag|>", "llama3_json"),
]
"""What a chat template contains when it was written for each format (first match wins)."""


def detect_format(chat_template: str | None) -> str:
    """The format a chat template writes tool calls in (its markers: :data:`MARKERS`)."""
    for marker, name in MARKERS:
        if chat_template and marker in chat_template:
            return name
    if chat_template and '"parameters"' in chat_template and "ipython" in chat_template:
        return "llama3_json"
    raise ToolFormatError(
        "env.options.format = 'auto', but the tokenizer's chat template has none of the tool-call markers "
        f"of {', '.join(sorted(TOOL_FORMATS))}: name the format the model was trained on"
    )


class ResponseTemplateFormat:
    """Calls read by transformers' response parser from a response template (the schema a
    tokenizer ships as ``response_template``, or a JSON file): its ``tool_calls`` are the calls,
    a region it cannot parse (a call cut mid-JSON) makes the turn malformed."""

    markers: tuple[str, ...] = ()  # its patterns read the text as decoded with special tokens skipped

    def __init__(self, template: dict[str, Any]) -> None:
        from transformers.utils.chat_parsing import parse_response
        from transformers.utils.chat_parsing.response_templates import load_response_template

        try:
            self.template = load_response_template(template)
        except (ValueError, TypeError, KeyError) as error:
            raise ToolFormatError(f"env.options.format: not a valid response template: {error}") from None
        self._parse = parse_response

    def parse(self, text: str) -> ParsedTurn:
        try:
            message = self._parse(text, self.template, prefix="")
            calls = [call_from(call.get("function", call), "arguments") for call in message.get("tool_calls") or []]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            return ParsedTurn("malformed", content=text, error=str(error).splitlines()[0])
        content = message.get("content") or ""
        return ParsedTurn("parsed", calls, content.strip()) if calls else ParsedTurn("no_call", content=content or text)

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        raise ToolFormatError("a response template reads calls; name a format (hermes, ...) to write them")


def resolve_format(name: str, chat_template: str | None = None, response_template: dict | None = None) -> Any:
    """The format ``name`` names, built: a registered one, a response template file (``.json``),
    or with ``auto`` the tokenizer's ``response_template`` when it has one, else the format its
    chat template is written for."""
    if not isinstance(name, str):
        raise ToolFormatError(
            f"env.options.format is {name!r:.60}: name a format ({', '.join(TOOL_FORMATS)} or auto) or a .json "
            "response template"
        )
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ToolFormatError(f"env.options.format: response template file {name} does not exist")
        try:
            template = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested past the stack
            why = "nested thousands of levels deep" if isinstance(error, RecursionError) else error
            raise ToolFormatError(f"env.options.format: {name} is not a JSON response template ({why})") from None
        return ResponseTemplateFormat(template)
    if name == "auto" and response_template:
        return ResponseTemplateFormat(response_template)
    name = detect_format(chat_template) if name == "auto" else name
    if name not in TOOL_FORMATS:
        raise ToolFormatError(
            f"env.options.format: {TOOL_FORMATS.unknown_message(name)} (or a .json response template)"
        )
    return TOOL_FORMATS[name]()


def tokenizer_format(name: str, tokenizer: Any) -> Any:
    """:func:`resolve_format` for the policy's tokenizer: its chat template and response template,
    or for one with neither (mistral-common's renders with its own encoder) the format whose
    marker is one of its special tokens."""
    from posttrain.envs.turn_text import kept_markers

    templates = getattr(tokenizer, "chat_template", None), getattr(tokenizer, "response_template", None)
    if name == "auto" and not any(templates):
        templates = (next((marker for marker, _ in MARKERS if kept_markers(tokenizer, [marker])), None), None)
    return resolve_format(name, *templates)
