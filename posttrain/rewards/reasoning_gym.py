"""The ``reasoning_gym`` reward: a reasoning-gym task's own scorer on the extracted answer.

The answer is read from the completion as the ``math`` reward reads it (the last
``<answer>…</answer>``, else the last ``\\boxed{}``, else the last number); no answer scores
0. Rows carry their entry as JSON (``reasoning_gym_entry``, see
``posttrain.data.tasks.reasoning_gym``), so one reward scores rows of any task, mixed too.
Scores are the task's: usually 1.0 right, 0.0 wrong, partial credit where it defines some.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from posttrain.rewards.math_answer import extract_answer
from posttrain.rewards.registry import register_reward
from posttrain.rewards.rules import completion_text

ENTRY_COLUMN = "reasoning_gym_entry"


@register_reward("reasoning_gym")
def reasoning_gym_reward(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any
) -> list[float]:
    """Score each completion with its row's reasoning-gym scorer."""
    from posttrain.data.tasks.reasoning_gym import require_reasoning_gym

    gym = require_reasoning_gym()
    if ENTRY_COLUMN not in columns:
        raise ValueError(
            f"reward 'reasoning_gym' needs the {ENTRY_COLUMN!r} column that data.task: reasoning_gym:<name> "
            f"writes; the dataset has: {', '.join(sorted(columns)) or 'no extra columns'}"
        )
    scores = []
    for completion, raw in zip(completions, columns[ENTRY_COLUMN], strict=True):
        entry = json.loads(raw) if isinstance(raw, str) else raw
        answer = extract_answer(completion_text(completion))
        if answer is None:
            scores.append(0.0)
            continue
        scorer = gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
        scores.append(float(scorer(answer, entry)))
    return scores
