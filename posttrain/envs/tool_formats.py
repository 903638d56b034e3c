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
* ``mistral`` — ``[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "a1b2c3d4e"}]``
  (tokenizer v3), or ``[TOOL_CALLS]add[ARGS]{"a": 1}`` per call (v11 and later).

``detect_format(chat_template)`` picks one from the markers a template contains (``auto``).
A tokenizer that ships a *response template* (transformers ≥ 5.13: ``tokenizer.response_template``,
read by ``tokenizer.parse_response``) is parsed by it instead (:class:`ResponseTemplateFormat`),
and so is a response template given as a JSON file (``format: my_template.json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.algos.registry import Registry
from posttrain.envs.turn_text import first_marker
from posttrain.errors import PosttrainError

Status = Literal["parsed", "malformed", "no_call"]


class ToolFormatError(PosttrainError, ValueError):
    """A format cannot be chosen (``env.options.format``, or ``auto`` on a template without markers)."""


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


def _call(payload: Any, arguments_key: str) -> ToolCall:
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


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {text.strip()[:120]!r}") from None


@TOOL_FORMATS.register("hermes")
class Hermes:
    """``<tool_call>{json}</tool_call>`` blocks, any number, anywhere in the turn.

    Each block's JSON is decoded where it starts, so a closing tag inside a JSON string (an
    argument quoting the format) does not end the block; a turn that ends in an unclosed block or
    in the first letters of an opening tag was cut, and is malformed rather than a final answer."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def parse(self, text: str) -> ParsedTurn:
        if self.OPEN not in text and not self._cut_open(text):
            return ParsedTurn("no_call", content=text)
        try:
            payloads, content = self._blocks(text)
            calls = [_call(item, "arguments") for payload in payloads for item in self._items(payload)]
        except ValueError as error:
            return ParsedTurn("malformed", content=text, error=str(error))
        return ParsedTurn("parsed", calls, content.strip())

    def _items(self, payload: Any) -> list[Any]:
        return [payload]  # one call per block

    def _blocks(self, text: str) -> tuple[list[Any], str]:
        """(the decoded JSON of every block, the text outside them); ValueError saying why not."""
        payloads, outside, position = [], [], 0
        while (start := text.find(self.OPEN, position)) >= 0:
            outside.append(text[position:start])
            body = start + len(self.OPEN)
            while body < len(text) and text[body].isspace():
                body += 1
            if self.CLOSE not in text[body:]:
                raise ValueError(f"{self.OPEN} without {self.CLOSE} (cut by max_new_tokens?)")
            payload, end = _raw(text[body:])
            close = text.find(self.CLOSE, body + end)
            if close < 0 or text[body + end : close].strip():
                raise ValueError(f"{self.OPEN}: text after its JSON where {self.CLOSE} belongs")
            payloads.append(payload)
            position = close + len(self.CLOSE)
        outside.append(text[position:])
        if self._cut_open(text[position:]):
            raise ValueError(f"the turn ends in {text[position:].rstrip()[-len(self.OPEN) :]!r}: a cut {self.OPEN}")
        return payloads, "".join(outside)

    def _cut_open(self, text: str) -> bool:
        tail = text.rstrip()
        return any(tail.endswith(self.OPEN[:k]) for k in range(2, len(self.OPEN)))

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        blocks = [f"{self.OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{self.CLOSE}" for c in calls]
        return "\n".join(([content] if content else []) + blocks)


@TOOL_FORMATS.register("smollm2")
class SmolLM2(Hermes):
    """SmolLM2's function calling: one ``<tool_call>`` block holding a JSON *list* of calls,
    ``<tool_call>[{"name": "add", "arguments": {"a": 1}}, ...]</tool_call>`` (a single object is
    read too, as Hermes writes it). Its chat template does not list tools: name them in the
    environment's ``system`` option (``{tools}`` is replaced by their schemas)."""

    def _items(self, payload: Any) -> list[Any]:
        return payload if isinstance(payload, list) else [payload]

    def parse(self, text: str) -> ParsedTurn:
        """As Hermes; a turn whose every block is the empty list is SmolLM2's "no call is needed"
        (its tool prompt: "If no function call is needed, please make the tool calls an empty
        list '[]'"): a final answer, the text around the blocks its content."""
        turn = super().parse(text)
        if turn.status == "parsed" and not turn.calls:
            return ParsedTurn("no_call", content=turn.content)
        return turn

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        body = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
        return "\n".join(([content] if content else []) + [f"{self.OPEN}{body}{self.CLOSE}"])


@TOOL_FORMATS.register("llama3_json")
class Llama3Json:
    """The whole turn is a call: a JSON object with ``name`` and ``parameters`` (Meta's Llama 3.1
    prompt format, "JSON based tool calling"; ``;`` and any whitespace between parallel calls, as
    vLLM's ``llama3_json`` parser reads them). An ``<|python_tag|>`` may open the turn: after it the
    turn is a call, so nothing or something other than JSON there is malformed, not an answer."""

    TAG = "<|python_tag|>"
    markers = (TAG,)

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        body = body[len(self.TAG) :].lstrip() if tagged else body
        if tagged and not body.startswith("{"):
            why = "nothing" if not body else repr(body[:60])
            return ParsedTurn("malformed", content=text, error=f"{self.TAG} is followed by {why}, not a JSON call")
        if not body.startswith("{"):
            return ParsedTurn("no_call", content=text)
        decoder, calls, position = json.JSONDecoder(), [], 0
        try:
            while position < len(body):
                try:
                    payload, end = decoder.raw_decode(body, position)
                except json.JSONDecodeError as error:
                    raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {body[:120]!r}") from None
                calls.append(_call(payload, "parameters"))
                position = end
                while position < len(body) and (body[position] == ";" or body[position].isspace()):
                    position += 1
        except ValueError as error:
            return ParsedTurn("malformed", content=text, error=str(error))
        return ParsedTurn("parsed", calls)

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


@TOOL_FORMATS.register("mistral")
class Mistral:
    """Mistral's tool calls, as mistral-common's instruct encoders write them (``InstructTokenizerV3``
    to ``V13``, ``tokens/tokenizers/instruct.py``): the turn's content, then either ``[TOOL_CALLS]``
    and a JSON list of calls (v3, v7: ``[{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}]``) or,
    per call, ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}`` (v11; v13 writes no ``[CALL_ID]``), then EOS.

    Read in order from the first marker: each ``[TOOL_CALLS]`` opens a list or a call, and a JSON
    value is decoded where it starts, so arguments quoting a marker do not split the call. The turn
    is malformed, never an answer, when a ``[TOOL_CALLS]`` is followed by nothing (cut), a call has
    no ``[ARGS]`` or an empty name, or text follows the last call (the encoders write none there:
    it would be dropped when the turn is written back)."""

    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (MARK, ARGS, CALL_ID)

    def parse(self, text: str) -> ParsedTurn:
        first = first_marker(text, self.MARK)  # a marker quoted as text in the content is text
        if first < 0:
            return ParsedTurn("no_call", content=str(text))
        content, rest = text[:first], text[first + len(self.MARK) :]
        try:
            calls = self._calls(rest)
        except ValueError as error:
            return ParsedTurn("malformed", content=text, error=str(error))
        return ParsedTurn("parsed", calls, content.strip())

    def _calls(self, rest: str) -> list[ToolCall]:
        """The calls after the first ``[TOOL_CALLS]`` (``rest``), each list or call in turn."""
        calls: list[ToolCall] = []
        while True:
            body = rest.lstrip()
            if not body:
                raise ValueError(f"the turn ends at {self.MARK}: a cut call")
            if body.startswith("["):  # v3/v7: one JSON list
                payload, end = _raw(body)
                if not isinstance(payload, list) or not payload:
                    raise ValueError(f"{self.MARK} is followed by a JSON list of calls, got {body[:120]!r}")
                calls += [_call(item, "arguments") for item in payload]
            else:  # v11: name, an optional [CALL_ID], [ARGS] and the arguments
                call, end = self._named_call(body)
                calls.append(call)
            after = body[end:].lstrip()
            if not after:
                return calls
            if not after.startswith(self.MARK):
                raise ValueError(f"text after the last call, where the turn ends: {after[:80]!r}")
            rest = after[len(self.MARK) :]

    def _named_call(self, body: str) -> tuple[ToolCall, int]:
        args = body.find(self.ARGS)
        if args < 0 or self.MARK in body[:args]:
            raise ValueError(f"{self.MARK}{body[:40]} has no {self.ARGS} (cut by max_new_tokens?)")
        name, marker, call_id = body[:args].partition(self.CALL_ID)
        name, call_id = name.strip(), call_id.strip() if marker else None
        if not name or any(c.isspace() or c in "[]{}" for c in name):
            raise ValueError(f"{self.MARK} is followed by a tool name, got {name[:40]!r}")
        start = args + len(self.ARGS)
        start += len(body[start:]) - len(body[start:].lstrip())
        payload, end = _raw(body[start:])
        call = _call({"name": name, "arguments": payload}, "arguments")
        return ToolCall(call.name, call.arguments, call_id or None), start + end

    @staticmethod
    def call_id(number: int) -> str:
        """The id of the ``number``-th tool result of an episode whose call the model wrote without
        one: Mistral's chat templates refuse a tool message without a 9-character alphanumeric
        ``tool_call_id``. Counted, not random, so a resumed run renders the same tokens."""
        return f"{number:09d}"[-9:]

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        items = [{"name": c.name, "arguments": c.arguments, **({"id": c.id} if c.id else {})} for c in calls]
        return content + self.MARK + json.dumps(items)


def _raw(text: str) -> tuple[Any, int]:
    try:
        return json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {text[:120]!r}") from None


MARKERS = [("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")]
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
            calls = [_call(call.get("function", call), "arguments") for call in message.get("tool_calls") or []]
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
