"""Running a plain (sync) tool function so that nothing it does ends or hangs the run.

Each call runs in a daemon thread of its own (``envs/base.py`` ``in_daemon_thread``), never in a
thread pool: a pool's workers are joined at exit, so one tool that never returns hung the trainer
after ``done``, and a few such tools held every worker, timing out each later call. A thread that
never returns is kept; at most ``SYNC_CALLS_AT_ONCE`` are, then calls are answered with an error.

A tool's way out is its own error, answered to the model, not the run's end: ``sys.exit`` raises
``SystemExit`` (which would end the event loop it is handed to), and ``os._exit`` would end the
process at once, exit status and all, with nothing trained or saved. While a tool runs,
``os._exit`` called from its thread raises instead (:func:`_exit_unless_from_a_tool`); from any
other thread, or in a process forked from the tool's thread, it exits as always.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

SYNC_CALLS_AT_ONCE = 64
_sync_calls = threading.BoundedSemaphore(SYNC_CALLS_AT_ONCE)
_in_a_tool = threading.local()  # .pid: the process whose tool this thread is running, while it runs
_process_exit = os._exit


class ToolExited(Exception):
    """A sync tool called ``sys.exit`` or ``os._exit``: answered to the model as the tool's error."""

    def __init__(self, code: Any, how: str = "sys.exit") -> None:
        super().__init__(f"{how}({code!r})")
        self.code, self.how = code, how


class _ToolCalledProcessExit(SystemExit):
    """``os._exit`` from a tool's thread: a ``SystemExit``, so a tool's ``except Exception`` does
    not swallow it and it unwinds the tool's own ``finally`` blocks."""


def try_to_start_sync_call() -> bool:
    """Take a place among the running sync calls; False when all ``SYNC_CALLS_AT_ONCE`` are held."""
    return _sync_calls.acquire(blocking=False)


def released_after(function: Callable[..., Any]) -> Callable[[dict[str, Any]], Any]:
    """``function(**arguments)`` for ``in_daemon_thread``, after :func:`try_to_start_sync_call`:
    gives its place back when it returns, and turns the tool's exits into :class:`ToolExited`."""
    _guard_process_exit()

    def call(arguments: dict[str, Any]) -> Any:
        _in_a_tool.pid = os.getpid()
        try:
            return function(**arguments)
        except _ToolCalledProcessExit as exit:
            raise ToolExited(exit.code, "os._exit") from None
        except SystemExit as exit:
            raise ToolExited(exit.code) from None
        finally:
            _in_a_tool.pid = None
            _sync_calls.release()

    return call


def _exit_unless_from_a_tool(status: int) -> None:
    if getattr(_in_a_tool, "pid", None) == os.getpid():
        raise _ToolCalledProcessExit(status)
    _process_exit(status)


def _guard_process_exit() -> None:
    """Put the guard in ``os._exit``'s place, once: only when tools run (not at import)."""
    if os._exit is not _exit_unless_from_a_tool:
        os._exit = _exit_unless_from_a_tool
