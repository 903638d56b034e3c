"""The ``code`` reward: program extraction, test-case columns, and scoring through RewardSet."""

from __future__ import annotations

import json
import math

import pytest

import posttrain.rewards.code  # noqa: F401  (registers "code")
from posttrain.rewards import REWARDS, RewardFunctionError, RewardSet, resolve_reward
from posttrain.rewards.code import TestCase, extract_program, parse_tests

from .conftest import require_bwrap

ADD = "def add(a, b):\n    return a + b"


@pytest.mark.parametrize(
    ("text", "program"),
    [
        ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)\n"),
        ("Sure:\n```py\nx = 1\n```", "x = 1\n"),
        ("```Python3\nx = 3\n```", "x = 3\n"),
        ("```\nnot tagged\n```", "```\nnot tagged\n```"),
        ("print(5)", "print(5)"),
    ],
)
def test_the_program_is_the_last_python_block_else_the_text(text, program):
    assert extract_program(text) == program


def test_test_columns_in_every_accepted_shape():
    assert parse_tests([{"input": "1", "output": "2"}, {"assert": "assert f() == 1"}, "assert g()"]) == [
        TestCase("1", "2"),
        TestCase(code="assert f() == 1"),
        TestCase(code="assert g()"),
    ]
    assert parse_tests(json.dumps([{"input": "a", "output": "b"}])) == [TestCase("a", "b")]
    assert parse_tests({"inputs": ["1", "2"], "outputs": ["3", "4"]}) == [TestCase("1", "3"), TestCase("2", "4")]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[not json", "tests of row 3 are a string but not JSON"),
        (5, "tests of row 3 must be a list"),
        ([{"stdin": "1"}], "test 0 of row 3 must be"),
        (["assert f(:"], "test 0 of row 3 does not compile"),
    ],
)
def test_bad_test_columns_name_the_row(value, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(value, row=3)


@pytest.fixture(scope="module")
def code_reward():
    require_bwrap()
    return resolve_reward({"name": "code", "limits": {"wall_s": 2, "cpu_s": 1, "memory_mb": 512}, "workers": 2})


def test_reward_is_the_fraction_of_tests_passed(code_reward):
    assert "code" in REWARDS
    completions = [
        f"```python\n{ADD}\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",
        "```python\nprint(sum(map(int, input().split())))\n```",
        [{"role": "assistant", "content": f"```python\n{ADD}\n```"}],
        "no code at all",
    ]
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]
    io = [{"input": "1 2", "output": "3"}, {"input": "5 5", "output": "11"}]
    tests = [asserts, asserts, io, json.dumps(asserts[:2]), []]
    result = RewardSet([code_reward]).score(["p"] * 5, completions, [[1]] * 5, {"tests": tests})
    scores = result.scores.tolist()
    assert scores[:4] == pytest.approx([1.0, 1 / 3, 0.5, 1.0])
    assert math.isnan(scores[4])  # no tests: None, masked
    assert result.metrics["reward/code/verdict/pass"] == pytest.approx(7 / 10)
    assert result.metrics["reward/code/infra_error_share"] == 0.0
    assert result.metrics["reward/code/no_tests_share"] == pytest.approx(1 / 5)


def test_missing_test_column_and_bad_options_are_explained(code_reward):
    with pytest.raises(RewardFunctionError, match="needs a test-case column 'tests'; the dataset has: answer"):
        RewardSet([code_reward]).score(["p"], ["x"], [[1]], {"answer": ["1"]})
    with pytest.raises(ValueError, match="max_infra_error_share"):
        resolve_reward({"name": "code", "max_infra_error_share": 2.0})
    with pytest.raises(ValueError, match="bad options"):
        resolve_reward({"name": "code", "limits": {"wall": 2}})
