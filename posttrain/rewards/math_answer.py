"""Math answer reward: extract the final answer, compare it with the reference by value.

Extraction order (first that applies): the last ``<answer>…</answer>`` block, then the last
``\\boxed{…}``, then the last number in the text. Comparison uses ``math-verify`` (LaTeX,
fractions, sympy equivalence) after a fast numeric check with relative tolerance.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from math_verify import parse, verify

from posttrain.rewards.registry import register_reward
from posttrain.rewards.rules import completion_text, reference_column

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer a completion states, as text; None when it states none."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def answers_match(predicted: str, reference: str, rel_tol: float = 1e-6) -> bool:
    """True when the two answers are equal as numbers (within ``rel_tol``) or as maths."""
    a, b = _as_number(predicted), _as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=rel_tol)
    # math-verify's timeouts use SIGALRM, which only the main thread may set; reward
    # functions often run in worker threads, where we go without the timeout
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(reference), parsing_timeout=timeout)
    guess = parse(_as_latex(predicted), parsing_timeout=timeout)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=timeout))


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _as_latex(text: str) -> str:
    # math-verify extracts answers from LaTeX environments; a bare "3/4" parses as well
    return text if "$" in text or "\\" in text else f"${text}$"


@register_reward("math")
def math_answer(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any):
    """1.0 when the extracted final answer equals the reference answer, else 0.0.

    The reference is the ``answer`` (or ``solution``) column. A completion that states no
    answer scores 0.0 (a wrong response, not a missing reward).
    """
    references = reference_column("math", columns)
    scores = []
    for completion, reference in zip(completions, references, strict=True):
        predicted = extract_answer(completion_text(completion))
        gold = extract_answer(str(reference)) or str(reference)
        scores.append(float(predicted is not None and answers_match(predicted, gold)))
    return scores
