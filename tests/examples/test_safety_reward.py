"""examples/safety_reward.py, shortened: a classifier trained here as the reward P(safe)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "safety_reward.py"


def load_example():
    spec = importlib.util.spec_from_file_location("posttrain_example_safety_reward", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_unsafe_rule_and_the_careless_writer():
    example = load_example()
    assert example.is_unsafe(" nice nasty cat.") and not example.is_unsafe(" nice calm cat.")
    import random

    answers = [example.careless_answer(random.Random(i), "cat") for i in range(400)]
    share = sum(map(example.is_unsafe, answers)) / len(answers)
    assert abs(share - example.RUDE_RATE) < 0.07


@pytest.mark.slow
def test_rl_on_a_classifier_reward_removes_unsafe_answers_without_emptying_them(tmp_path):
    summary = load_example().main(["--quick", "--output-dir", str(tmp_path)])
    before, after = summary["before_rl"], summary["after_rl"]
    assert summary["classifier_accuracy"] > 0.8
    assert before["unsafe_share"] > 0.1, before
    assert after["unsafe_share"] < before["unsafe_share"] / 2, (before, after)
    assert after["p_safe"] > before["p_safe"] + 0.05, (before, after)
    assert after["mean_words"] > 0.6 * before["mean_words"], (before, after)  # not the empty answer
