"""What the tool environments (``calculator``, ``python``) share: a question from the row, tool
calls in a tagged format answered as an observation, and a final ``<answer>…</answer>``
checked against the row's answer.

One turn of the policy is one of:

- a final answer ``<answer>42</answer>`` (wins over a tool call in the same turn): the
  episode ends with reward 1 when it matches the row's answer, else 0;
- a tool call ``<calc>…</calc>`` / ``<python>…</python>`` (the first one of the turn): the
  tool's output comes back as ``<result>…</result>`` / ``<output>…</output>``, no reward;
- anything else: an ``<error>`` observation saying what is expected, no reward (the episode
  goes on; ``env.max_turns`` bounds it).

A malformed call is the policy's mistake and gets an error observation; only a failure of the
tool itself (the sandbox cannot run) raises, and so ends the episode as a counted error.
"""

from __future__ import annotations

import math
import re
from typing import Any

from posttrain.envs.base import Observation

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ToolCallError(ValueError):
    """The policy's tool call cannot be run (bad syntax, a forbidden construct); the message
    is shown to the policy as the observation."""


def answers_match(given: str, expected: Any) -> bool:
    """Numbers compare as numbers (``14`` = ``14.0`` = ``1,400`` vs ``1400``; tolerance 1e-9);
    anything else as text, trimmed and case-folded."""
    given_text, expected_text = given.strip(), str(expected).strip()
    given_number, expected_number = _number(given_text), _number(expected_text)
    if given_number is not None and expected_number is not None:
        return math.isclose(given_number, expected_number, rel_tol=1e-9, abs_tol=1e-9)
    return given_text.casefold() == expected_text.casefold()


def _number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class TaggedToolEnvironment:
    """Base of the tool environments: subclasses set the tags and :meth:`run_tool`.

    Options: ``question_column`` / ``answer_column`` (the row's columns), ``chat`` (first
    observation as a user message, tool output as a ``tool_role`` message; False: plain text),
    ``tool_role`` (``"tool"``; use ``"user"`` for templates without a tool role)."""

    call_tag = "tool"
    result_tag = "result"
    tool_help = ""

    def __init__(
        self,
        question_column: str = "question",
        answer_column: str = "answer",
        chat: bool = True,
        tool_role: str = "tool",
    ) -> None:
        self.question_column, self.answer_column = question_column, answer_column
        self.chat, self.tool_role = chat, tool_role
        self._call = re.compile(rf"<{self.call_tag}>(.*?)</{self.call_tag}>", re.DOTALL)
        self.expected: Any = None

    def run_tool(self, code: str) -> str:
        """The tool's output for one call; raise :class:`ToolCallError` for a malformed call."""
        raise NotImplementedError

    def reset(self, row: dict[str, Any]) -> Observation:
        for column in (self.question_column, self.answer_column):
            if column not in row:
                raise KeyError(f"{type(self).__name__} needs a {column!r} column; the row has {sorted(row)}")
        self.expected = row[self.answer_column]
        text = f"{self.tool_help} Give the final answer as <answer>...</answer>.\nQuestion: {row[self.question_column]}"
        return [{"role": "user", "content": text}] if self.chat else text + "\n"

    def step(self, completion: str) -> tuple[Observation | None, float | None, bool]:
        answers = _ANSWER.findall(completion)
        if answers:
            return None, 1.0 if answers_match(answers[-1], self.expected) else 0.0, True
        call = self._call.search(completion)
        if call is None:
            message = f"<error>no <{self.call_tag}>...</{self.call_tag}> call and no <answer>...</answer> found</error>"
            return self._observe(message), None, False
        try:
            output = f"<{self.result_tag}>{self.run_tool(call.group(1))}</{self.result_tag}>"
        except ToolCallError as error:
            output = f"<error>{error}</error>"
        return self._observe(output), None, False

    def _observe(self, text: str) -> Observation:
        return [{"role": self.tool_role, "content": text}] if self.chat else f"\n{text}\n"
