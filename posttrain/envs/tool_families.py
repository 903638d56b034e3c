"""Tool calls as each model family writes them: one class per format, each parsing a policy turn
into a :class:`~posttrain.envs.tool_calls.ParsedTurn` and rendering calls back into the family's
text, each rule stated with its published source (``tool_formats.py`` has the overview)."""

from __future__ import annotations

import json
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
        return content + self.MARK + json.dumps(items)
