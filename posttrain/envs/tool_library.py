"""Ready-made tools for the ``tools`` environment, plain functions like a user's own:
``env.options.tools: [posttrain.envs.tool_library:python, posttrain.envs.tool_library:calculate]``.

``python`` runs the model's code in posttrain's code sandbox (``rewards/sandbox.py``, the jail the
``code`` reward uses: no network, no files of the trainer, wall/CPU/memory limits), one sandbox
per process; ``calculate`` evaluates arithmetic by walking its syntax tree, never ``eval``
(``calculator.py``)."""

from __future__ import annotations

from posttrain.envs.calculator import evaluate, format_number
from posttrain.envs.python_tool import DEFAULT_LIMITS, run_in_sandbox, shared_sandbox
from posttrain.envs.tools import ToolCallError


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: the program; print what you want to see
    """
    return run_in_sandbox(shared_sandbox(DEFAULT_LIMITS, False), code, max_output_chars=2000)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. 2 * (3 + 4)
    """
    try:
        return format_number(evaluate(expression))
    except ToolCallError as error:  # the policy's mistake: its message is the answer
        return f"error: {error}"
