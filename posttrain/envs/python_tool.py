"""The ``python`` environment: ``<python>print(6 * 7)</python>`` runs in posttrain's code sandbox
(``rewards/sandbox.py``, the jail the ``code`` reward uses) and its stdout comes back as
``<output>42</output>``; a final ``<answer>…</answer>`` is checked as in ``calculator``.

What the program sees and may do is the sandbox's business (its "covers / does not cover"):
no network, no files of the trainer, wall/CPU/memory limits. Here: the output is cut to
``max_output_chars``; a program that raises gets its stdout plus the last line of its stderr
(the exception, which a policy can learn from); a timeout or memory kill is said as such. A
sandbox that cannot run at all (``infra_error``) is not the policy's fault: the step raises,
and the episode ends as a counted error, not as a turn the policy lost.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from posttrain.envs.base import register_environment
from posttrain.envs.tools import TaggedToolEnvironment
from posttrain.rewards.sandbox import Limits, Sandbox, Verdict

DEFAULT_LIMITS = Limits(wall_s=5.0, cpu_s=3.0, memory_mb=512, output_bytes=64 << 10)


class ToolSandboxError(RuntimeError):
    """The sandbox could not run the program (its runner failed); ends the episode as an error."""


@functools.lru_cache(maxsize=8)
def shared_sandbox(limits: Limits, unsafe_local: bool) -> Sandbox:
    """One checked sandbox per (limits, unsafe_local) in this process: every episode builds its
    own environment, and a sandbox's start-up check (two jailed runs) and cgroup set-up are
    too dear to repeat per episode."""
    sandbox = Sandbox(limits, unsafe_local=unsafe_local, label="posttrain-env-python")
    sandbox.check()
    return sandbox


@register_environment("python")
class PythonTool(TaggedToolEnvironment):
    """Python tool calls run in the sandbox. Options: those of :class:`TaggedToolEnvironment`,
    plus ``limits`` (a mapping of sandbox :class:`Limits` fields), ``unsafe_local`` (no jail;
    see the sandbox) and ``max_output_chars``."""

    call_tag = "python"
    result_tag = "output"
    tool_help = "You may run Python with <python>code</python>; what it prints comes back as <output>...</output>."

    def __init__(
        self,
        question_column: str = "question",
        answer_column: str = "answer",
        chat: bool = True,
        tool_role: str = "tool",
        limits: Mapping[str, Any] | Limits | None = None,
        unsafe_local: bool = False,
        max_output_chars: int = 500,
    ) -> None:
        super().__init__(question_column, answer_column, chat, tool_role)
        if isinstance(limits, Mapping):
            limits = Limits(**limits)
        self.sandbox = shared_sandbox(limits or DEFAULT_LIMITS, unsafe_local)
        self.max_output_chars = max_output_chars

    def run_tool(self, code: str) -> str:
        return run_in_sandbox(self.sandbox, code, self.max_output_chars)


def run_in_sandbox(sandbox: Sandbox, code: str, max_output_chars: int) -> str:
    """What a program prints in ``sandbox``, as a tool answers: stdout, then the exception's last
    line if it raised, or why it was stopped; cut to ``max_output_chars``. A sandbox that cannot
    run at all raises :class:`ToolSandboxError` (not the policy's fault: the episode's error)."""
    result = sandbox.run_io(code, "", "")
    if result.verdict is Verdict.INFRA_ERROR:
        raise ToolSandboxError(f"the sandbox ({sandbox.runner}) could not run the program: {result.detail}")
    output = result.stdout.decode("utf-8", "replace").rstrip("\n")
    if result.verdict is Verdict.TIMEOUT:
        output += f"\n[stopped: {result.detail}]"
    elif result.verdict is Verdict.MEMORY:
        output += "\n[stopped: memory limit exceeded]"
    elif result.verdict is Verdict.CRASH:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        output += "\n" + (lines[-1] if lines else f"[{result.detail}]")
    return _cut(output.strip("\n"), max_output_chars)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"...[{len(text) - limit} more characters]"
