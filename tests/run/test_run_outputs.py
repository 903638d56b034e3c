"""Which completions of a step are logged: the best, the worst and the median by reward first (an
unscored one ranks lowest), then others spread over the ranks, each once."""

from __future__ import annotations

import math

from posttrain.run.run_outputs import spread_by_reward


def test_the_best_the_worst_and_the_median_come_first():
    scores = [0.5, math.nan, 1.0, 0.0, 0.2]
    assert spread_by_reward(scores, 3) == [2, 1, 4]
    assert spread_by_reward(scores, 0) == []
    assert sorted(spread_by_reward(scores, 10)) == [0, 1, 2, 3, 4]  # all of them, each once
    assert spread_by_reward([], 4) == []
