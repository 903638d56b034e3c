"""Tools that misbehave and options of the wrong kind (hardening 3, items 4, 6, 16 and 17): a sync
tool that never returns is answered at its timeout and costs nothing later — every later call still
runs, and the trainer still exits (a thread pool's workers were joined at exit, so ``done`` was
printed and the process never ended; and the pool's few workers, once stuck, timed out every later
call); a tool calling ``sys.exit`` is the tool's error, answered to the model, not the end of the
run; a tool may be a ``functools.partial``; options of the wrong kind are one message."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from posttrain.envs import resolve_environment
from posttrain.envs.tool_formats import ToolCall
from posttrain.errors import PosttrainError
from tests.envs.test_tools_env import step, tools_env, turn

REPO = Path(__file__).resolve().parents[2]
NEVER = threading.Event()  # never set


def stuck(x: int) -> int:
    NEVER.wait()
    return x


def exits(code: int) -> int:
    sys.exit(code)


def exits_at_once(code: int) -> int:
    try:
        os._exit(code)
    except Exception:  # a tool swallowing every error does not swallow its own exit
        return -1
    return -2


def forks_a_child_that_exits(code: int) -> int:
    """os._exit in a process forked from the tool's thread exits that process, as always."""
    child = os.fork()
    if child == 0:
        os._exit(code)
    return os.waitpid(child, 0)[1] >> 8


def add(a: int, b: int) -> int:
    return a + b


# the trainer's shape: one event loop kept for every episode (envs/event_loop.py), then the interpreter exits
ON_ONE_LOOP = textwrap.dedent(
    """
    import asyncio
    from posttrain.envs.tool_formats import ToolCall
    from tests.envs.test_tools_env import tools_env, turn
    env = tools_env("stuck", "add", timeout_s=0.2, max_calls_per_turn=16, module="tests.envs.test_tools_hostile")
    env.reset({"prompt": "go"})
    loop = asyncio.new_event_loop()
    for _ in range(3):  # more stuck calls than a default pool has workers (min(32, cores + 4))
        replies, _, _ = loop.run_until_complete(env.step(turn(*[ToolCall("stuck", {"x": 1})] * 12)))
        assert all("did not answer within" in reply["content"] for reply in replies), replies
    replies, _, _ = loop.run_until_complete(env.step(turn(ToolCall("add", {"a": 2, "b": 3}))))
    print("answer:", replies[0]["content"], flush=True)
    """
)


def test_sync_tools_that_never_return_leave_later_calls_and_the_exit_alone():
    process = subprocess.run(
        [sys.executable, "-c", ON_ONE_LOOP], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-2000:]
    assert "answer: 5" in process.stdout


def test_a_tool_calling_sys_exit_is_its_error_answered_to_the_model():
    env = tools_env("exits", "add", module="tests.envs.test_tools_hostile")
    env.reset({"prompt": "go"})
    replies, _, done = step(env, turn(ToolCall("exits", {"code": 0}), ToolCall("add", {"a": 1, "b": 2})))
    assert "exits" in replies[0]["content"] and "sys.exit(0)" in replies[0]["content"]
    assert replies[1]["content"] == "3" and not done
    assert env.episode_metrics()["tools/error_fraction"] == 0.5


ON_ONE_LOOP_AT_ONCE = textwrap.dedent(
    """
    import asyncio, os
    from posttrain.envs.tool_formats import ToolCall
    from tests.envs.test_tools_env import tools_env, turn
    env = tools_env("exits_at_once", "add", module="tests.envs.test_tools_hostile")
    env.reset({"prompt": "go"})
    loop = asyncio.new_event_loop()
    replies, _, _ = loop.run_until_complete(env.step(turn(ToolCall("exits_at_once", {"code": 0}))))
    print("reply:", replies[0]["content"], flush=True)
    replies, _, _ = loop.run_until_complete(env.step(turn(ToolCall("add", {"a": 2, "b": 3}))))
    print("answer:", replies[0]["content"], env.episode_metrics()["tools/error_fraction"], flush=True)
    os._exit(3)  # the trainer's own os._exit still ends the process
    """
)


def test_a_tool_calling_os_exit_is_its_error_and_the_run_goes_on():
    """Hardening 3, item 16: a tool calling os._exit(0) ended the run at once with exit status 0,
    having trained and saved nothing."""
    process = subprocess.run(
        [sys.executable, "-c", ON_ONE_LOOP_AT_ONCE], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert "reply: error: exits_at_once called os._exit(0)" in process.stdout, (process.stdout, process.stderr[-2000:])
    assert "answer: 5 0.5" in process.stdout and process.returncode == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX")
def test_os_exit_in_a_process_forked_by_a_tool_exits_that_process():
    env = tools_env("forks_a_child_that_exits", module="tests.envs.test_tools_hostile")
    env.reset({"prompt": "go"})
    replies, _, _ = step(env, turn(ToolCall("forks_a_child_that_exits", {"code": 7})))
    assert replies[0]["content"] == "7"  # the child's exit status: it exited, it did not go on as a tool


add_two = functools.partial(add, b=2)


def test_a_partial_function_is_a_tool_named_by_its_path():
    env = tools_env("add_two", module="tests.envs.test_tools_hostile")
    assert env.chat_tools[0]["function"]["name"] == "add_two"
    env.reset({"prompt": "go"})
    replies, _, _ = step(env, turn(ToolCall("add_two", {"a": 3})))
    assert replies[0]["content"] == "5"


def bad_options(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    """Hardening 3, items 6 and 16: each was a traceback or silently accepted (a negative limit)."""
    not_utf8, deep = tmp_path / "latin.json", tmp_path / "deep.json"
    not_utf8.write_bytes(b"\xff\xfe{bad")
    deep.write_text("[" * 100_000 + "]" * 100_000)
    return {
        "format a number": ({"format": 5}, "env.options.format is 5: name a format"),
        "template not UTF-8": ({"format": str(not_utf8)}, "latin.json is not a JSON response template"),
        "template nested deep": ({"format": str(deep)}, "deep.json is not a JSON response template (nested"),
        "tools a string": ({"tools": "m:add"}, "env.options.tools is 'm:add': a list of 'pkg.module:function'"),
        "tools numbers": ({"tools": [1, 2]}, "env.options.tools is [1, 2]: a list"),
        "negative calls": ({"max_calls_per_turn": -1}, "env.options.max_calls_per_turn is -1: a positive whole"),
        "negative timeout": ({"timeout_s": -5}, "env.options.timeout_s is -5: a positive number"),
        "no result": ({"max_result_chars": 0}, "env.options.max_result_chars is 0: a positive whole number"),
        "true timeout": ({"timeout_s": True}, "env.options.timeout_s is True"),
    }


CASES = ["format a number", "template not UTF-8", "template nested deep", "tools a string", "tools numbers"]
CASES += ["negative calls", "negative timeout", "no result", "true timeout"]


@pytest.mark.parametrize("case", CASES)
def test_options_of_the_wrong_kind_are_one_message_before_a_model_loads(tmp_path, case):
    options, message = bad_options(tmp_path)[case]
    options = {"tools": ["tests.envs.test_tools_hostile:add"], "format": "hermes", **options}
    with pytest.raises(PosttrainError) as raised:
        resolve_environment("tools", options)
    assert message in str(raised.value)


def circular(x: int) -> list:
    loop: list = []
    loop.append(loop)
    return loop


def enormous(x: int) -> int:
    return 10**5000


def test_a_call_nested_thousands_deep_is_the_policys_malformed_call():
    """Hardening 3, item 17: a RecursionError, reported as the environment's failure."""
    env = tools_env("add", module="tests.envs.test_tools_hostile")
    env.reset({"prompt": "go"})
    nested = "[" * 5000 + "]" * 5000
    replies, _, done = step(env, '<tool_call>\n{"name": "add", "arguments": {"a": ' + nested + "}}\n</tool_call>")
    assert not done and "nests thousands of levels deep" in replies[0]["content"]
    assert env.episode_metrics()["tools/malformed_fraction"] == 1.0


def test_a_result_that_cannot_be_written_is_the_tools_error():
    env = tools_env("circular", "enormous", "add", module="tests.envs.test_tools_hostile")
    env.reset({"prompt": "go"})
    calls = [ToolCall("circular", {"x": 1}), ToolCall("enormous", {"x": 1}), ToolCall("add", {"a": 1, "b": 1})]
    replies, _, _ = step(env, turn(*calls))
    assert [reply["content"].partition(" (")[0] for reply in replies[:2]] == [
        "error: circular returned a value that cannot be written as JSON",
        "error: enormous returned a value that cannot be written as JSON",
    ]
    assert replies[2]["content"] == "2" and env.episode_metrics()["tools/error_fraction"] == 2 / 3


def test_a_tool_module_that_calls_sys_exit_on_import_is_one_message(tmp_path, monkeypatch):
    """Hardening 3, item 16: the run ended with status 0, having trained nothing."""
    (tmp_path / "script_with_exit.py").write_text("import sys\n\ndef f(x: int) -> int:\n    return x\n\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PosttrainError, match=r"importing 'script_with_exit' called sys.exit\(0\)"):
        resolve_environment("tools", {"tools": ["script_with_exit:f"], "format": "hermes"})
