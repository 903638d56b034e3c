"""Tool calls as each model family writes them: one class per format, each parsing a policy turn
into a :class:`~posttrain.envs.tool_calls.ParsedTurn` and rendering calls back into the family's
text, each rule stated with its published source (``tool_formats.py`` has the overview)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from posttrain.envs.tool_calls import TOOL_FORMATS, ParsedTurn, ToolCall, call_from, json_at
from posttrain.envs.turn_text import first_marker


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
            calls = [call_from(item, "arguments") for payload in payloads for item in self._items(payload)]
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
            payload, end = json_at(text[body:])
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
                calls.append(call_from(payload, "parameters"))
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
        return _content_then_calls(text, first, text[first + len(self.MARK) :], self._calls)

    def _calls(self, rest: str) -> list[ToolCall]:
        """The calls after the first ``[TOOL_CALLS]`` (``rest``), each list or call in turn."""
        calls: list[ToolCall] = []
        while True:
            body = rest.lstrip()
            if not body:
                raise ValueError(f"the turn ends at {self.MARK}: a cut call")
            if body.startswith("["):  # v3/v7: one JSON list
                payload, end = json_at(body)
                if not isinstance(payload, list) or not payload:
                    raise ValueError(f"{self.MARK} is followed by a JSON list of calls, got {body[:120]!r}")
                calls += [call_from(item, "arguments") for item in payload]
            else:  # v11: name, an optional [CALL_ID], [ARGS] and the arguments
                call, end = self._namedcall_from(body)
                calls.append(call)
            after = body[end:].lstrip()
            if not after:
                return calls
            if not after.startswith(self.MARK):
                raise ValueError(f"text after the last call, where the turn ends: {after[:80]!r}")
            rest = after[len(self.MARK) :]

    def _namedcall_from(self, body: str) -> tuple[ToolCall, int]:
        args = body.find(self.ARGS)
        if args < 0 or self.MARK in body[:args]:
            raise ValueError(f"{self.MARK}{body[:40]} has no {self.ARGS} (cut by max_new_tokens?)")
        name, marker, call_id = body[:args].partition(self.CALL_ID)
        name, call_id = name.strip(), call_id.strip() if marker else None
        if not name or any(c.isspace() or c in "[]{}" for c in name):
            raise ValueError(f"{self.MARK} is followed by a tool name, got {name[:40]!r}")
        start = args + len(self.ARGS)
        start += len(body[start:]) - len(body[start:].lstrip())
        payload, end = json_at(body[start:])
        call = call_from({"name": name, "arguments": payload}, "arguments")
        return ToolCall(call.name, call.arguments, call_id or None), start + end

    @staticmethod
    def call_id(number: int) -> str:
        """The id of the ``number``-th tool result of an episode whose call the model wrote without
        one: Mistral's chat templates refuse a tool message without a 9-character alphanumeric
        ``tool_call_id``. Counted, not random, so a resumed run renders the same tokens."""
        return f"{number:09d}"[-9:]

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        items = [{"name": c.name, "arguments": c.arguments, **({"id": c.id} if c.id else {})} for c in calls]
        return content + self.MARK + json.dumps(items, ensure_ascii=False)  # as mistral-common writes it


@TOOL_FORMATS.register("deepseek_v3")
class DeepSeekV3:
    """DeepSeek V3's tool calls, as its published chat template writes them (and vLLM's
    ``deepseek_v3`` parser reads them): the content, then ``<｜tool▁calls▁begin｜>`` and per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>``,
    then ``<｜tool▁calls▁end｜>``. The template leaves out the closing marker after a single call
    (and the opening one in a later turn), so both are optional here; a call not closed by
    ``<｜tool▁call▁end｜>`` was cut, and text after the calls is malformed."""

    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    OPEN_ARGUMENTS, CLOSE_ARGUMENTS = "\n```json\n", "\n```"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, SEP, CALL_END)

    def parse(self, text: str) -> ParsedTurn:
        starts = [i for i in (first_marker(text, self.CALLS_BEGIN), first_marker(text, self.CALL_BEGIN)) if i >= 0]
        first = min(starts, default=-1)
        return _content_then_calls(text, first, text[first:].removeprefix(self.CALLS_BEGIN), self._calls)

    def _calls(self, rest: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        while True:
            rest = rest.lstrip()
            if not rest.startswith(self.CALL_BEGIN):
                raise ValueError(f"{self.CALL_BEGIN} was expected, got {rest[:60]!r} (cut by max_new_tokens?)")
            head, sep, body = rest[len(self.CALL_BEGIN) :].partition(self.SEP)
            name, newline, body = body.partition("\n")
            if not sep or not newline or head.strip() != "function":
                raise ValueError(f"a call is {self.CALL_BEGIN}function{self.SEP}NAME and its JSON: {rest[:80]!r}")
            if not body.startswith("```json\n"):
                raise ValueError(f"the arguments of {name!r} open with ```json (cut by max_new_tokens?)")
            body = body[len("```json\n") :]
            arguments, end = json_at(body)
            close = self.CLOSE_ARGUMENTS + self.CALL_END
            if not body[end:].startswith(close):
                raise ValueError(f"the call to {name!r} is not closed by ```{self.CALL_END} (cut by max_new_tokens?)")
            calls.append(call_from({"name": name.strip(), "arguments": arguments}, "arguments"))
            rest = body[end + len(close) :].lstrip()
            if rest in ("", self.CALLS_END):
                return calls
            if not rest.startswith(self.CALL_BEGIN):
                raise ValueError(f"text after the last call, where the turn ends: {rest[:80]!r}")

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        body = "\n".join(
            f"{self.CALL_BEGIN}function{self.SEP}{c.name}{self.OPEN_ARGUMENTS}{json.dumps(c.arguments)}"
            f"{self.CLOSE_ARGUMENTS}{self.CALL_END}"
            for c in calls
        )
        return f"{content}{self.CALLS_BEGIN}{body}{self.CALLS_END}"


@TOOL_FORMATS.register("pythonic")
class Pythonic:
    """Llama 3.2's (and Llama 4's) pythonic tool calls, Meta's ``python_list`` format: the turn is a
    Python list of calls with keyword arguments, ``[add(a=1, b=2), search(query="x")]``, after an
    optional ``<|python_tag|>`` (Meta's Llama 3.2 prompt format; vLLM's ``pythonic`` parser).
    Arguments are Python literals (``True``, ``None``, dicts, lists), read by ``ast.literal_eval``
    and given as JSON. A turn opening like a call but not a complete list of them (cut, or
    positional arguments) is malformed; a list whose first item is no call is an answer."""

    TAG = "<|python_tag|>"
    markers = (TAG,)

    def parse(self, text: str) -> ParsedTurn:
        import ast
        import re

        body = text.strip().removeprefix(self.TAG).strip()
        if not re.match(r"\[\s*[A-Za-z_][\w.]*\s*\(", body):
            if text.strip().startswith(self.TAG):
                return ParsedTurn("malformed", content=text, error=f"{self.TAG} is followed by no call list")
            return ParsedTurn("no_call", content=str(text))
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
                raise ValueError(f"a list of calls, got {body[:80]!r}")
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, MemoryError) as error:
            why = "not a complete Python list (cut by max_new_tokens?)" if isinstance(error, SyntaxError) else error
            return ParsedTurn("malformed", content=text, error=str(why))
        return ParsedTurn("parsed", calls)

    def _call(self, node: Any) -> ToolCall:
        import ast

        name = ast.unparse(node.func)
        if node.args or any(keyword.arg is None for keyword in node.keywords):
            raise ValueError(f"{name}: arguments are given by keyword")
        arguments = {keyword.arg: _json_like(ast.literal_eval(keyword.value), name) for keyword in node.keywords}
        return ToolCall(name, arguments)

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        return "[" + ", ".join(f"{c.name}({_keywords(c.arguments)})" for c in calls) + "]"


def _content_then_calls(text: str, first: int, rest: str, read: Callable[[str], list[ToolCall]]) -> ParsedTurn:
    """A turn whose content runs up to its first call marker at ``first`` (-1: none, the turn is
    the answer) and whose calls ``read(rest)`` finds after it; malformed, saying why, where
    ``read`` raises."""
    if first < 0:
        return ParsedTurn("no_call", content=str(text))
    try:
        calls = read(rest)
    except ValueError as error:
        return ParsedTurn("malformed", content=text, error=str(error))
    return ParsedTurn("parsed", calls, text[:first].strip())


def _json_like(value: Any, name: str) -> Any:
    """A Python literal as JSON has it (tuples as lists); ValueError for what JSON has not (sets, bytes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_like(item, name) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_like(item, name) for key, item in value.items()}
    raise ValueError(f"{name}: an argument is not JSON-like: {type(value).__name__}")


def _keywords(arguments: dict[str, Any]) -> str:
    if not all(key.isidentifier() for key in arguments):
        raise ValueError(f"pythonic calls name their arguments as Python keywords, got {sorted(arguments)}")
    return ", ".join(f"{key}={_literal(value)}" for key, value in arguments.items())


def _literal(value: Any) -> str:
    """``value`` written as a Python literal (JSON's strings are Python's, unicode kept)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(key)}: {_literal(item)}" for key, item in value.items()) + "}"
    return repr(value)  # None, True, False, numbers
