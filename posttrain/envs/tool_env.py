"""The ``tools`` environment: a model calls plain Python functions in its own chat format.

``env: {name: tools, options: {tools: [mymod:add, mymod:mul], format: auto}}``. The functions'
JSON schemas (from their type hints and docstrings, as ``transformers.utils.get_json_schema``
writes them) go to the chat template's ``tools``, so the model sees them as it was trained to.
Each policy turn is parsed in ``format`` (``tool_formats.py``; ``auto``: the one the tokenizer's
template is written for):

* no call: the turn is the final answer and the episode ends; ``rewards=`` functions score the
  conversation with the row's columns;
* calls: each runs with a timeout (``async def`` tools awaited, others in a daemon thread of their
  own: a tool that never returns keeps its thread, not the trainer's exit nor later calls), several in
  one turn at once; their results come back in call order as the template's tool messages, cut
  to ``max_result_chars`` (and marked so); more than ``max_calls_per_turn`` are answered with an
  error, as are an unknown tool, arguments that do not fit its signature, and a tool that raises;
* a malformed call (bad JSON, a call cut by ``max_new_tokens``) is answered by
  ``malformed_reply`` as the tool result — never skipped in silence.

A function may take a parameter named ``state``: a dict that lives for the episode (a tool that
keeps state between calls); it is not part of the schema. Every turn's parse status is counted
(``episode_metrics``: ``tools/calls_per_episode``, ``tools/malformed_fraction``,
``tools/unknown_fraction``, ``tools/error_fraction``, ``tools/episodes_with_a_call``) and the
first malformed turns are kept as examples for the message that stops a run whose malformed
share passes ``env.max_malformed_fraction``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from posttrain.envs.base import EnvSpecError, Observation, in_daemon_thread, register_environment
from posttrain.envs.python_tool import ToolSandboxError
from posttrain.envs.sync_tool_calls import SYNC_CALLS_AT_ONCE, ToolExited, released_after, try_to_start_sync_call
from posttrain.envs.tool_formats import ParsedTurn, ToolCall, parse_turn, resolve_format, tokenizer_format
from posttrain.user_code import import_named

TOOLS_OFF_REPLY = "error: the tools are off in this conversation; answer without them"

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def tool_schema(function: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The JSON schema a chat template's ``tools`` takes for ``function`` (called ``name``, by
    default its own): transformers' own (type hints and a Google-style docstring); for a function
    without such a docstring, one from its signature alone (``state`` is the episode's, never the
    model's)."""
    name = name or tool_name(function)
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
        schema["function"]["name"] = name
        schema["function"]["parameters"]["properties"].pop("state", None)
        required = schema["function"]["parameters"].get("required", [])
        schema["function"]["parameters"]["required"] = [name for name in required if name != "state"]
        return schema
    except Exception:  # no docstring, or arguments it does not describe: the signature says enough
        pass
    properties, required = {}, []
    try:
        hints = typing.get_type_hints(function)  # annotations written as strings resolved
    except Exception:  # a hint that names something not importable: the parameter stays untyped
        hints = {}
    for argument, parameter in inspect.signature(function).parameters.items():
        if argument == "state" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[argument] = {"type": JSON_TYPES.get(hints[argument], "string")} if argument in hints else {}
        if parameter.default is parameter.empty:
            required.append(argument)
    description = inspect.getdoc(function) or name
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def tool_name(function: Callable[..., Any], path: str = "") -> str:
    """What the model calls a tool: the function's name (a ``functools.partial`` or a callable object
    has none of its own: its path's last part)."""
    name = getattr(function, "__name__", None)
    return name if isinstance(name, str) and name.isidentifier() else path.rpartition(":")[2].rpartition(".")[2]


def resolve_tools(paths: list[str]) -> dict[str, Callable[..., Any]]:
    """``env.options.tools`` (``pkg.module:function`` paths, importable from the working
    directory) → the functions by name; a wrong path or a name used twice is one message."""
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise EnvSpecError(
            f"env.options.tools is {paths!r:.60}: a list of 'pkg.module:function' paths, e.g. [mymod:add, mymod:mul]"
        )
    if not paths:
        raise EnvSpecError("env.options.tools is empty: list the functions, e.g. [mymod:add, mymod:mul]")
    functions: dict[str, Callable[..., Any]] = {}
    for path in paths:
        function = import_named(
            path,
            what="env.options.tools entry",
            malformed=f"env.options.tools: {path!r} is not 'pkg.module:function'",
            error=EnvSpecError,
        )
        if not callable(function):
            raise EnvSpecError(f"env.options.tools: {path} is not a function")
        name = tool_name(function, path)
        if name in functions:
            raise EnvSpecError(f"env.options.tools: two tools are named {name!r}")
        functions[name] = function
    return functions


MALFORMED_REPLY = "error: the tool call could not be read ({error}); write it as the format asks"


@register_environment("tools")
class ToolsEnvironment:
    """See the module docstring. Options: ``tools`` (paths), ``format`` (``auto`` | ``hermes`` |
    ``smollm2`` | ``llama3_json`` | ``mistral`` | a response template ``.json``), ``prompt_column``,
    ``timeout_s`` (per call), ``max_calls_per_turn``, ``max_result_chars``, ``malformed_reply``
    (``{error}`` is filled in), ``system`` (a system message before the row's prompt, or none; ``{tools}`` in it is
    replaced by the tools' schemas, one JSON line each, for templates that do not list them) and
    ``tools_off`` (the ablation: the tools are offered as usual, but every call is answered with
    ``TOOLS_OFF_REPLY`` and runs nothing — what the policy scores without their results)."""

    def __init__(
        self,
        tools: list[str],
        format: str = "auto",
        prompt_column: str = "prompt",
        timeout_s: float = 10.0,
        max_calls_per_turn: int = 8,
        max_result_chars: int = 2000,
        malformed_reply: str = MALFORMED_REPLY,
        system: str | None = None,
        tools_off: bool = False,
    ) -> None:
        self.functions = resolve_tools(tools)
        self.chat_tools = [tool_schema(function, name) for name, function in self.functions.items()]
        self.format_name, self.prompt_column, self.timeout_s = format, prompt_column, timeout_s
        self.max_calls_per_turn, self.max_result_chars = max_calls_per_turn, max_result_chars
        self.malformed_reply, self.system, self.tools_off = malformed_reply, system, tools_off
        self.format: Any = None if format == "auto" else resolve_format(format)  # auto: the tokenizer's
        self.state: dict[str, Any] = {}
        self.counts = {"turns": 0, "malformed": 0, "calls": 0, "unknown": 0, "bad_arguments": 0, "errors": 0}
        self.turns: list[ParsedTurn] = []
        self.results = 0  # tool messages so far, which number the ids given to calls written without one

    @staticmethod
    def check_options(tools: list[str], format: str = "auto", **options: Any) -> None:
        """At start-up, before any model loads: every tool imports, a named format exists, and the
        limits are positive numbers."""
        resolve_tools(tools)
        if format != "auto":
            resolve_format(format)
        limits = {"timeout_s": (int, float), "max_calls_per_turn": int, "max_result_chars": int}
        for key, kinds in limits.items():
            value = options.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
                raise EnvSpecError(f"env.options.{key} is {value!r:.40}: a positive {'whole ' * (kinds is int)}number")

    # --------------------------------------------------------------------------- the contract
    def use_tokenizer(self, tokenizer: Any) -> None:
        """The policy's tokenizer, before ``reset``: ``format: auto`` reads its chat template."""
        if self.format is None:
            self.format = tokenizer_format(self.format_name, tokenizer)

    @property
    def turn_markers(self) -> tuple[str, ...]:
        """The format's markers, which a turn's text keeps where they are special tokens
        (``turn_text.py``): the episode decodes each turn with them."""
        return tuple(getattr(self.format, "markers", ()))

    def reset(self, row: dict[str, Any]) -> Observation:
        if self.prompt_column not in row:
            raise KeyError(f"the tools environment reads column {self.prompt_column!r}; the row has {sorted(row)}")
        prompt = row[self.prompt_column]
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not self.system:
            return messages
        # a template that lists no tools (SmolLM2's) learns of them from the system message
        listed = "\n".join(json.dumps(schema) for schema in self.chat_tools)
        return [{"role": "system", "content": self.system.replace("{tools}", listed)}, *messages]

    async def step(self, completion: str) -> tuple[Observation | None, float | None, bool]:
        if self.format is None:  # no tokenizer was handed over (a test, a caller of its own)
            self.format = resolve_format(self.format_name)
        turn = parse_turn(self.format, completion)
        self.turns.append(turn)
        self.counts["turns"] += 1
        if turn.status == "no_call":
            return None, None, True
        if turn.status == "malformed":
            self.counts["malformed"] += 1
            reply = self.malformed_reply.replace("{error}", turn.error or "")  # other braces stay as written
            return [self._message(reply, None)], None, False
        calls = turn.calls[: self.max_calls_per_turn]
        results = await asyncio.gather(*(self._run(call) for call in calls))
        over = turn.calls[self.max_calls_per_turn :]
        results += [f"error: more than {self.max_calls_per_turn} calls in one turn; this one was not run"] * len(over)
        return [self._message(result, call) for result, call in zip(results, turn.calls, strict=True)], None, False

    def episode_metrics(self) -> dict[str, float]:
        """This episode's tool use; the source averages each over the episodes of a batch."""
        counts, calls = self.counts, max(self.counts["calls"], 1)
        return {
            "tools/calls_per_episode": float(counts["calls"]),
            "tools/malformed_fraction": counts["malformed"] / max(counts["turns"], 1),
            "tools/unknown_fraction": counts["unknown"] / calls,
            "tools/bad_arguments_fraction": counts["bad_arguments"] / calls,
            "tools/error_fraction": counts["errors"] / calls,
            "tools/episodes_with_a_call": float(counts["calls"] > 0),
        }

    def malformed_examples(self) -> list[str]:
        """The malformed turns of this episode: what the policy wrote, and why it could not be read."""
        return [f"{turn.content[:200]!r}: {turn.error}" for turn in self.turns if turn.status == "malformed"]

    # --------------------------------------------------------------------------- calls
    async def _run(self, call: ToolCall) -> str:
        self.counts["calls"] += 1
        function = self.functions.get(call.name)
        if function is None:
            self.counts["unknown"] += 1
            return f"error: no tool is named {call.name!r}; the tools are {', '.join(self.functions)}"
        if self.tools_off:
            return TOOLS_OFF_REPLY
        arguments = dict(call.arguments)
        if "state" in inspect.signature(function).parameters:
            arguments["state"] = self.state
        try:
            inspect.signature(function).bind(**arguments)
        except TypeError as error:
            self.counts["bad_arguments"] += 1
            return f"error: bad arguments for {call.name}: {error}"
        try:
            if inspect.iscoroutinefunction(function):
                result = await asyncio.wait_for(function(**arguments), self.timeout_s)
            elif not try_to_start_sync_call():
                self.counts["errors"] += 1
                return f"error: {call.name} was not run: {SYNC_CALLS_AT_ONCE} tool calls are still running"
            else:
                result = await asyncio.wait_for(in_daemon_thread(released_after(function), arguments), self.timeout_s)
        except ToolExited as exit:  # the tool's own way out, not the run's
            self.counts["errors"] += 1
            return f"error: {call.name} called {exit.how}({exit.code!r})"
        except asyncio.TimeoutError:
            self.counts["errors"] += 1
            return f"error: {call.name} did not answer within {self.timeout_s:g} s"
        except ToolSandboxError:  # the sandbox cannot run at all: not the policy's fault, the episode's error
            raise
        except Exception as error:  # the tool's own failure is the model's observation, and counted
            self.counts["errors"] += 1
            return f"error: {call.name} raised {type(error).__name__}: {error}"
        try:
            text = result if isinstance(result, str) else json.dumps(result, default=str)
        except (ValueError, TypeError, RecursionError) as error:  # circular, an int past str()'s limit, ...
            self.counts["errors"] += 1
            return f"error: {call.name} returned a value that cannot be written as JSON ({type(error).__name__})"
        return self._cut(text)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return text
        return text[: self.max_result_chars] + f"…[cut: {len(text) - self.max_result_chars} more characters]"

    def _message(self, content: str, call: ToolCall | None) -> dict[str, Any]:
        """A tool message answering ``call`` (None: the turn could not be read), with the call's id,
        or one in the family's form where its template requires one (``call_id`` of the format)."""
        self.results += 1
        message: dict[str, Any] = {"role": "tool", "content": content}
        if call is not None:
            message["name"] = call.name
        new_id = getattr(self.format, "call_id", None)
        call_id = call.id if call is not None and call.id else new_id(self.results) if new_id else None
        if call_id:
            message["tool_call_id"] = call_id
        return message
