"""Tools that misbehave (hardening 3, items 4 and 17): a sync tool that never returns is answered at
its timeout and costs nothing later — every later call still runs, and the trainer still exits (a
thread pool's workers were joined at exit, so ``done`` was printed and the process never ended; and
the pool's few workers, once stuck, timed out every later call) — and a tool calling ``sys.exit`` is
the tool's error, answered to the model, not the end of the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from posttrain.envs.tool_formats import ToolCall
from tests.envs.test_tools_env import step, tools_env, turn

REPO = Path(__file__).resolve().parents[2]
NEVER = threading.Event()  # never set


def stuck(x: int) -> int:
    NEVER.wait()
    return x


def exits(code: int) -> int:
    sys.exit(code)


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
