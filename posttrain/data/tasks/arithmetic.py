"""Short arithmetic word problems with numeric answers (seed 000, example 2, R1-Zero style).

``"Tom has 3 apples and buys 5 more. How many apples does Tom have?"`` → ``"8"``. Six
templates, two each for +, − and ×, filled with a name, an item and small numbers (sums of
1–20, differences that stay ≥ 0, products of 2–9), so that a tiny character-level model can
learn the task. Completions show the worked step in the seed's format,
``<think> 3 + 5 = 8 </think><answer> 8 </answer>``, for a short SFT before RL; the ``answer``
column is what the ``math`` reward checks.

Held-out prompts never occur in training, but the same sum may, worded differently (as in
any word-problem set): the task tests reading a new problem and doing small arithmetic, not
discovering multiplication facts never seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from posttrain.data.loading import DataError


@dataclass(frozen=True)
class Template:
    question: str  # with {name}, {items}, {a} and {b}
    op: str  # "+", "-" or "*", as written in the completion


TEMPLATES = (
    Template("{name} has {a} {items} and buys {b} more. How many {items} does {name} have?", "+"),
    Template("A jar holds {a} {items}. {name} adds {b} more. How many {items} are in the jar?", "+"),
    Template("{name} has {a} {items} and gives away {b}. How many {items} are left?", "-"),
    Template("A shelf has {a} {items}. {name} takes {b} away. How many {items} remain?", "-"),
    Template("{name} has {a} bags with {b} {items} in each. How many {items} in all?", "*"),
    Template("There are {a} boxes of {b} {items}. How many {items} are there?", "*"),
)
NAMES = ("Tom", "Ann", "Sam", "Lee", "Mia", "Max", "Zoe", "Ben")
ITEMS = ("apples", "pens", "coins", "books", "cards", "eggs", "shells", "stamps")
OPERANDS = {
    "+": [(a, b) for a in range(1, 21) for b in range(1, 21)],
    "-": [(a, b) for a in range(1, 21) for b in range(1, a + 1)],  # b ≤ a: nothing negative
    "*": [(a, b) for a in range(2, 10) for b in range(2, 10)],
}


def solve(op: str, a: int, b: int) -> int:
    """a op b."""
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def make_row(template: Template, name: str, items: str, a: int, b: int) -> dict[str, str]:
    """``{prompt, answer, completion}`` for one problem."""
    answer = str(solve(template.op, a, b))
    return {
        "prompt": template.question.format(name=name, items=items, a=a, b=b),
        "answer": answer,
        "completion": f"<think> {a} {template.op} {b} = {answer} </think><answer> {answer} </answer>",
    }


def sample_row(rng: random.Random) -> dict[str, str]:
    """One problem: the template uniformly (each operation a third of the time), then the rest."""
    template = rng.choice(TEMPLATES)
    return make_row(template, rng.choice(NAMES), rng.choice(ITEMS), *rng.choice(OPERANDS[template.op]))


def split_problems(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Disjoint (train, held_out) rows, deterministic by `seed`; no prompt is in both or twice.

    The held-out rows are drawn first, so they stay the same whatever `n_train` is.
    """
    limit = max_problems()
    if n_train + n_test > limit:
        raise DataError(f"asked for {n_train} + {n_test} problems; the arithmetic task draws at most {limit}")
    rng = random.Random(seed)
    seen: set[str] = set()
    held_out = _draw_distinct(n_test, rng, seen)
    return _draw_distinct(n_train, rng, seen), held_out


def max_problems() -> int:
    """How many distinct problems `split_problems` will draw in all.

    Each operation gets a third of the draws; capping them at half the prompts of the
    operation with the fewest (×) keeps drawing without repeats quick to the end.
    """
    per_op = {op: 0 for op in OPERANDS}
    for template in TEMPLATES:
        per_op[template.op] += len(NAMES) * len(ITEMS) * len(OPERANDS[template.op])
    return len(per_op) * min(per_op.values()) // 2


def _draw_distinct(n: int, rng: random.Random, seen: set[str]) -> list[dict[str, str]]:
    """`n` rows whose prompts are not in `seen` (which grows)."""
    rows = []
    while len(rows) < n:
        row = sample_row(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows
