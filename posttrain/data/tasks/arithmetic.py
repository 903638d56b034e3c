"""Short arithmetic word problems with numeric answers (seed 000, example 2, R1-Zero style).

Small numbers and a handful of templates, so that a tiny character-level model can learn the
task; completions show the worked step in the seed's format
``<think> 3 + 5 = 8 </think><answer> 8 </answer>`` for the short SFT before RL.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# (question template, operator symbol, result); numbers are drawn so results stay >= 0
TEMPLATES: tuple[tuple[str, str, Callable[[int, int], int]], ...] = (
    ("Tom has {a} apples and buys {b} more. How many apples does he have?", "+", lambda a, b: a + b),
    ("A jar holds {a} coins. Ann adds {b} coins. How many coins are in the jar?", "+", lambda a, b: a + b),
    ("Sam has {a} pens and gives away {b}. How many pens are left?", "-", lambda a, b: a - b),
    ("A shelf has {a} books. {b} are taken. How many books remain?", "-", lambda a, b: a - b),
    ("A box holds {a} eggs. How many eggs are in {b} boxes?", "*", lambda a, b: a * b),
)


def make_problem(rng: random.Random) -> tuple[int, int, int]:
    """(template index, a, b) with a ≥ b for subtraction and small factors for products."""
    index = rng.randrange(len(TEMPLATES))
    symbol = TEMPLATES[index][1]
    if symbol == "*":
        return index, rng.randint(2, 9), rng.randint(2, 9)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return (index, max(a, b), min(a, b)) if symbol == "-" else (index, a, b)


def make_row(index: int, a: int, b: int) -> dict[str, str]:
    template, symbol, result = TEMPLATES[index]
    answer = str(result(a, b))
    return {
        "prompt": template.format(a=a, b=b),
        "answer": answer,
        "completion": f"<think> {a} {symbol} {b} = {answer} </think><answer> {answer} </answer>",
    }


def split_problems(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows (no problem appears in both), deterministic by seed."""
    space = sum(81 if t[1] == "*" else 400 for t in TEMPLATES)
    if n_train + n_test > space:
        raise ValueError(f"only {space} distinct problems exist; asked for {n_train + n_test}")
    rng = random.Random(seed)
    seen: set[tuple[int, int, int]] = set()
    problems = []
    while len(problems) < n_train + n_test:
        problem = make_problem(rng)
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    rows = [make_row(*p) for p in problems]
    return rows[n_test:], rows[:n_test]
