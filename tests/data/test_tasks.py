"""Built-in tasks: deterministic, disjoint splits, correct answers, rule-consistent labels."""

from __future__ import annotations

import re

import pytest

from posttrain.data.tasks import TASKS, get_task
from posttrain.data.tasks.preference import KIND_WORDS, true_preference_score
from posttrain.models.tokenizers import DEFAULT_CHARSET


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_with_disjoint_splits(name):
    a, b, other = get_task(name)(200, 50, 0), get_task(name)(200, 50, 0), get_task(name)(200, 50, 1)
    assert a == b and a.train != other.train
    assert len(a.train) == 200 and len(a.held_out) == 50
    key = (lambda r: (r["prompt"], r["chosen"], r["rejected"])) if name == "preference" else (lambda r: r["prompt"])
    assert not {key(r) for r in a.train} & {key(r) for r in a.held_out}
    text = "".join(str(v) for r in a.train + a.held_out for v in r.values() if isinstance(v, str))
    assert set(text) <= set(DEFAULT_CHARSET), set(text) - set(DEFAULT_CHARSET)


def test_unknown_task_lists_the_valid_ones():
    with pytest.raises(KeyError, match="arithmetic, preference, reverse"):
        get_task("maths")


def test_arithmetic_answers_are_right():
    data = get_task("arithmetic")(300, 50, 3)
    for row in data.train + data.held_out:
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        symbol = re.search(r"<think> \d+ ([-+*]) \d+", row["completion"]).group(1)
        expected = {"+": a + b, "-": a - b, "*": a * b}[symbol]
        words = row["prompt"]
        assert (symbol == "+") == ("more" in words or "adds" in words)
        assert (symbol == "*") == ("boxes" in words)
        assert row["answer"] == str(expected) and row["completion"].endswith(f"<answer> {expected} </answer>")


def test_preference_rule_and_labels():
    assert true_preference_score("Describe the cat.", " nice warm cat.") == 3.0
    assert true_preference_score("Describe the cat.", " nice nice nice.") == 1.0 - 2.0  # repeats cost
    long_kind = " " + " ".join([*KIND_WORDS, "a", "b"]) + "."
    assert true_preference_score("Describe the cat.", long_kind) == 3.0 - 0.5 * 2
    data = get_task("preference")(500, 200, 0)
    for row in data.train:
        gap = true_preference_score(row["prompt"], row["chosen"]) - true_preference_score(
            row["prompt"], row["rejected"]
        )
        assert gap == row["margin"] > 0
    # not separable by length alone
    shorter_wins = sum(len(r["chosen"]) < len(r["rejected"]) for r in data.held_out) / len(data.held_out)
    assert 0.3 < shorter_wins < 0.75
