"""The ``calculator`` environment: ``<calc>2*(3+4)</calc>`` → ``<result>14</result>``, then a
final ``<answer>…</answer>`` checked against the row's answer (see ``tools.py``).

Expressions are evaluated here, in-process, by walking their ``ast``; nothing is ever passed
to ``eval``. Covers: only numeric literals (int, float), ``+ - * / // % **``, unary ``+ -``
and parentheses are accepted — names, calls, attributes, subscripts, strings, comparisons and
everything else are refused by name; expressions are at most ``max_chars`` long (which also
bounds the nesting depth); every intermediate value must stay within ±``max_abs`` and a power
is refused before it is computed when its result would not (no ``9**9**9`` stalling the
trainer); division by zero, complex results and non-finite floats become error messages.
Does not cover: precision — floats are IEEE doubles (``0.1+0.2`` gives ``0.30000000000000004``,
shown to 12 significant digits).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from posttrain.envs.base import register_environment
from posttrain.envs.tools import TaggedToolEnvironment, ToolCallError

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str, *, max_chars: int = 200, max_abs: float = 1e30) -> Number:
    """The value of an arithmetic expression, or :class:`ToolCallError` saying why not."""
    expression = expression.strip()
    if not expression:
        raise ToolCallError("empty expression")
    if len(expression) > max_chars:
        raise ToolCallError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolCallError(f"cannot parse {expression!r}") from None
    return _value(tree.body, max_abs)


def format_number(value: Number) -> str:
    """Integers as integers (also a float that is one, below 1e15), other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def _value(node: ast.AST, max_abs: float) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex, str
        return _bounded(node.value, max_abs)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, max_abs))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, max_abs), _value(node.right, max_abs)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right, max_abs)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolCallError("division by zero") from None
        except OverflowError:
            raise ToolCallError("result too large") from None
        if isinstance(result, complex):
            raise ToolCallError("the result is not a real number")
        return _bounded(result, max_abs)
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ToolCallError(f"not allowed in a calculation: {what} (only numbers, + - * / // % ** and parentheses)")


def _check_power(base: Number, exponent: Number, max_abs: float) -> None:
    # estimate |base|**exponent from logarithms before computing it: an int power is exact and
    # can take seconds and gigabytes (9**9**9) before any bound on the result could apply
    if base == 0:
        if exponent < 0:
            raise ToolCallError("division by zero")
        return
    if exponent * math.log10(abs(base)) > math.log10(max_abs):  # log10 |base ** exponent|
        raise ToolCallError("result too large")


def _bounded(value: Number, max_abs: float) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolCallError("result too large")
    if abs(value) > max_abs:
        raise ToolCallError("result too large")
    return value


@register_environment("calculator")
class Calculator(TaggedToolEnvironment):
    """Arithmetic tool calls ``<calc>…</calc>`` evaluated safely (module docstring), then a final
    ``<answer>…</answer>``. Options: those of :class:`TaggedToolEnvironment`, plus
    ``max_chars`` and ``max_abs`` (the evaluator's bounds)."""

    call_tag = "calc"
    result_tag = "result"
    tool_help = "You may compute with <calc>expression</calc>; the result comes back as <result>...</result>."

    def __init__(
        self,
        question_column: str = "question",
        answer_column: str = "answer",
        chat: bool = True,
        tool_role: str = "tool",
        max_chars: int = 200,
        max_abs: float = 1e30,
    ) -> None:
        # the options spelt out (no **kwargs): env.options are checked against them at start-up
        super().__init__(question_column, answer_column, chat, tool_role)
        self.max_chars, self.max_abs = max_chars, max_abs

    def run_tool(self, code: str) -> str:
        return format_number(evaluate(code, max_chars=self.max_chars, max_abs=self.max_abs))
