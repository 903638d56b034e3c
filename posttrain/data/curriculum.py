"""A curriculum over task difficulty: ``data.curriculum`` trains on easy problems first and moves
to harder ones once the policy solves the current ones often enough.

Each level is a set of ``task_options`` for a ``reasoning_gym:<name>`` task (merged over
``data.task_options``), e.g. letter counting over 1-2 words, then 1-5, then 5-10. ``n_train``
training rows are generated per level, each tagged with its level in the column
``curriculum_level`` (which reward functions receive, like any column); held-out rows come from
the *last* level, the goal the run is measured on.
Every step, the share of the batch's samples that passed (a weighted reward of at least
``pass_score``) is recorded; when its mean over the last ``window`` steps reaches ``advance_at``,
the next step draws from the next level. This is the level-advancing rule of reasoning-gym's own
curricula and of the "easy-to-hard" schedules in Kimi k1.5 (2025) and Light-R1 (2025): a
group-relative method learns nothing from a level it always (or never) solves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from posttrain.config import Section

LEVEL_COLUMN = "curriculum_level"
LEVEL_SEED_STRIDE = 7919  # level i draws its problems from seed + i * stride: distinct problems per level


class CurriculumSection(Section):
    levels: list[dict[str, Any]] = Field(min_length=2)
    """``task_options`` of each level, easiest first (each merged over ``data.task_options``)."""
    advance_at: float = Field(0.7, gt=0.0, le=1.0)
    """Move on when the batch pass rate, averaged over ``window`` steps, reaches this."""
    window: int = Field(2, ge=1)
    """Steps averaged (and at least this many steps at every level)."""
    pass_score: float = 1.0
    """A sample passed when its weighted reward is at least this."""


def curriculum_rows(
    make_task: Callable[[dict[str, Any]], Callable[[int, int, int], Any]],
    section: CurriculumSection,
    options: dict[str, Any],
    n_train: int,
    n_eval: int,
    seed: int,
) -> tuple[list[dict], list[dict], str | None]:
    """(training rows of every level, tagged with their level; held-out rows of the last level;
    the task's reward). ``make_task(options)`` is the task generator for those options."""
    last = len(section.levels) - 1
    goal = make_task({**options, **section.levels[last]})(n_train, n_eval, seed + last * LEVEL_SEED_STRIDE)
    questions = {str(row["prompt"]) for row in goal.held_out}
    train: list[dict] = []
    for level, level_options in enumerate(section.levels[:last]):
        rows = make_task({**options, **level_options})(n_train, 0, seed + level * LEVEL_SEED_STRIDE).train
        # an easier level's problem can also be a goal problem: never train on a held-out one
        train += [{**row, LEVEL_COLUMN: level} for row in rows if str(row["prompt"]) not in questions]
    train += [{**row, LEVEL_COLUMN: last} for row in goal.train]
    return train, [{**row, LEVEL_COLUMN: last} for row in goal.held_out], goal.reward
