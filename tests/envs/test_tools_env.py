"""The ``tools`` environment: plain functions become tools with schemas for the chat template;
calls run (in parallel, with a timeout) and answer in call order; every way a call can go wrong
is answered and counted, never skipped; a turn without a call ends the episode."""

from __future__ import annotations

import asyncio
import time

import pytest

from posttrain.envs import resolve_environment
from posttrain.envs.base import EnvSpecError
from posttrain.envs.tool_env import TOOLS_OFF_REPLY
from posttrain.envs.tool_formats import ToolCall, resolve_format

HERE = "tests.envs.test_tools_env"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def shout(text: str, times: int = 1):
    return (text.upper() + " ") * times


def fail(x: int) -> int:
    raise ZeroDivisionError("x was zero")


async def slow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def remember(item: str, state) -> list:
    state.setdefault("items", []).append(item)
    return state["items"]


def tools_env(*names: str, module: str = HERE, **options):
    return resolve_environment(
        "tools", {"tools": [f"{module}:{name}" for name in names], "format": "hermes", **options}
    )()


def turn(*calls: ToolCall) -> str:
    return resolve_format("hermes").render(list(calls))


def step(env, text):
    return asyncio.run(env.step(text))


def test_schemas_come_from_type_hints_and_docstrings_and_state_is_not_the_models():
    env = tools_env("add", "shout", "remember")
    add_schema, shout_schema, remember_schema = (tool["function"] for tool in env.chat_tools)
    assert add_schema["description"] == "Add two integers."
    assert add_schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first term"}
    # no docstring: the signature alone; a default makes an argument optional
    assert shout_schema["parameters"] == {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
        "required": ["text"],
    }
    assert remember_schema["parameters"]["properties"] == {"item": {"type": "string"}}


def test_calls_answer_in_call_order_and_a_turn_without_one_ends_the_episode():
    env = tools_env("add", "shout")
    assert env.reset({"prompt": "What is 2 + 3?"}) == [{"role": "user", "content": "What is 2 + 3?"}]
    observation, reward, done = step(
        env, turn(ToolCall("shout", {"text": "hi", "times": 2}), ToolCall("add", {"a": 2, "b": 3}))
    )
    assert observation == [
        {"role": "tool", "content": "HI HI ", "name": "shout"},
        {"role": "tool", "content": "5", "name": "add"},
    ]
    assert (reward, done) == (None, False)
    assert step(env, "The answer is 5.") == (None, None, True)
    assert env.episode_metrics()["tools/calls_per_episode"] == 2.0
    assert env.episode_metrics()["tools/episodes_with_a_call"] == 1.0


def test_with_the_tools_off_the_prompt_is_unchanged_and_every_call_is_answered_without_running():
    on, off = tools_env("add", "remember"), tools_env("add", "remember", tools_off=True)
    assert off.reset({"prompt": "2 + 3?"}) == on.reset({"prompt": "2 + 3?"}) and off.chat_tools == on.chat_tools
    observation, reward, done = step(off, turn(ToolCall("add", {"a": 2, "b": 3}), ToolCall("remember", {"item": "x"})))
    assert [m["content"] for m in observation] == [TOOLS_OFF_REPLY] * 2 and (reward, done) == (None, False)
    assert off.state == {}  # nothing ran
    assert off.episode_metrics()["tools/calls_per_episode"] == 2.0  # the attempts are counted
    assert step(off, "5") == (None, None, True)


def test_every_failure_is_answered_and_counted():
    env = tools_env("add", "fail", max_calls_per_turn=4)
    env.reset({"prompt": "go"})
    calls = [
        ToolCall("nope", {}),  # unknown
        ToolCall("add", {"a": 1}),  # a missing argument
        ToolCall("fail", {"x": 0}),  # raises
        ToolCall("add", {"a": 1, "b": 1, "c": 1}),  # an extra argument
        ToolCall("add", {"a": 1, "b": 2}),  # over the cap of 4
    ]
    observation, _, done = step(env, turn(*calls))
    answers = [message["content"] for message in observation]
    assert not done and len(answers) == 5
    assert answers[0].startswith("error: no tool is named 'nope'; the tools are add, fail")
    assert answers[1].startswith("error: bad arguments for add: missing a required argument: 'b'")
    assert answers[2] == "error: fail raised ZeroDivisionError: x was zero"
    assert answers[3].startswith("error: bad arguments for add")
    assert answers[4] == "error: more than 4 calls in one turn; this one was not run"
    malformed, _, _ = step(env, '<tool_call>\n{"name": "add", "argu')  # cut by the token budget
    assert malformed[0]["content"].startswith("error: the tool call could not be read (<tool_call> without")
    metrics = env.episode_metrics()
    assert metrics["tools/unknown_fraction"] == metrics["tools/error_fraction"] == 1 / 4
    assert metrics["tools/bad_arguments_fraction"] == 2 / 4 and metrics["tools/malformed_fraction"] == 1 / 2
    assert len(env.malformed_examples()) == 1 and "without </tool_call>" in env.malformed_examples()[0]


def test_parallel_calls_run_at_once_with_a_timeout_and_long_results_are_cut_and_marked():
    env = tools_env("slow", "shout", timeout_s=0.5, max_result_chars=20)
    env.reset({"prompt": "go"})
    started = time.perf_counter()
    observation, _, _ = step(env, turn(*[ToolCall("slow", {"seconds": 0.3})] * 3, ToolCall("slow", {"seconds": 5})))
    assert time.perf_counter() - started < 2.0  # three 0.3 s calls at once, the 5 s one stopped at 0.5 s
    assert [m["content"] for m in observation] == ["slept 0.3"] * 3 + ["error: slow did not answer within 0.5 s"]
    observation, _, _ = step(env, turn(ToolCall("shout", {"text": "abcdefghij", "times": 5})))
    assert observation[0]["content"] == "ABCDEFGHIJ ABCDEFGHI…[cut: 35 more characters]"


def test_a_tool_may_keep_state_within_its_episode_but_not_across_episodes():
    first = tools_env("remember")
    first.reset({"prompt": "go"})
    step(first, turn(ToolCall("remember", {"item": "a"})))
    observation, _, _ = step(first, turn(ToolCall("remember", {"item": "b"})))
    assert observation[0]["content"] == '["a", "b"]'
    second = tools_env("remember")
    second.reset({"prompt": "go"})
    assert step(second, turn(ToolCall("remember", {"item": "c"})))[0][0]["content"] == '["c"]'


def test_wrong_tool_paths_are_refused_when_the_environment_is_built():
    with pytest.raises(EnvSpecError, match=r"is not 'pkg\.module:function'"):
        resolve_environment("tools", {"tools": ["add"]})()
    with pytest.raises(EnvSpecError, match="has no attribute 'mul'"):
        resolve_environment("tools", {"tools": [f"{HERE}:mul"]})()
    with pytest.raises(EnvSpecError, match="is empty"):
        resolve_environment("tools", {"tools": []})()


def test_the_ready_made_tools_calculate_and_run_python_in_the_sandbox():
    import shutil

    library = "posttrain.envs.tool_library"
    env = resolve_environment("tools", {"tools": [f"{library}:calculate", f"{library}:python"], "format": "hermes"})()
    env.reset({"prompt": "go"})
    calls = [
        ToolCall("calculate", {"expression": "2 * (3 + 4)"}),
        ToolCall("calculate", {"expression": "__import__('os')"}),
    ]
    observation, _, _ = step(env, turn(*calls))
    assert observation[0]["content"] == "14" and observation[1]["content"].startswith(
        "error: not allowed in a calculation"
    )
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: the python tool's jail")
    observation, _, _ = step(
        env,
        turn(ToolCall("python", {"code": "print(6 * 7)\nimport socket\nsocket.create_connection(('1.1.1.1', 53), 2)"})),
    )
    output = observation[0]["content"]
    assert output.startswith("42\n") and "Error" in output  # the print, then the refused connection's exception
