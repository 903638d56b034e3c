"""A curriculum over difficulty: ``data.curriculum`` trains on easy rows first and moves to harder
ones once the policy solves the current ones often enough; for single-turn prompts and for
environment episodes alike (``sources/curriculum.py`` puts it over either source).

The levels are read from a data column: with ``column: difficulty``, each level is a value of
that column (``easy``), a list of values (``[1, 2]``) or a range (``{min: 3, max: 5}``, ends
included); a row that matches no level is never drawn. Or, for a ``reasoning_gym:<name>`` task and
no ``column``, each level is a set of ``task_options`` (merged over ``data.task_options``), e.g.
letter counting over 1-2 words, then 1-5, then 5-10: ``n_train`` training rows are generated per
level, each tagged with its level in the column ``curriculum_level`` (which reward functions
receive, like any column); held-out rows come from the *last* level, the goal the run is
measured on.
Every step, the share of the batch's samples that passed (a weighted reward of at least
``pass_score``) is recorded; when its mean over the last ``window`` steps reaches ``advance_at``,
the next step draws from the next level. This is the level-advancing rule of reasoning-gym's own
curricula and of the "easy-to-hard" schedules in Kimi k1.5 (2025) and Light-R1 (2025): a
group-relative method learns nothing from a level it always (or never) solves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field, model_validator

from posttrain.config import Section

LEVEL_COLUMN = "curriculum_level"
LEVEL_SEED_STRIDE = 7919  # level i draws its problems from seed + i * stride: distinct problems per level


class CurriculumSection(Section):
    levels: list[Any] = Field(min_length=2)
    """The levels, easiest first: with ``column``, each a value of it, a list of values or a
    ``{min, max}`` range (ends included, either may be left out); without, the ``task_options``
    of each level of a reasoning_gym task (each merged over ``data.task_options``)."""
    column: str | None = None
    """The data column the levels are read from (e.g. ``difficulty``); null: the levels are task
    options of ``data.task = reasoning_gym:<name>``, whose rows are tagged ``curriculum_level``."""
    advance_at: float = Field(0.7, gt=0.0, le=1.0)
    """Move on when the batch pass rate, averaged over ``window`` steps, reaches this."""
    window: int = Field(2, ge=1)
    """Steps averaged (and at least this many steps at every level)."""
    pass_score: float = 1.0
    """A sample passed when its weighted reward (an episode: its return) is at least this."""

    @model_validator(mode="after")
    def _levels_fit_their_kind(self) -> CurriculumSection:
        for index, level in enumerate(self.levels):
            if self.column is None and not isinstance(level, dict):
                raise ValueError(
                    f"data.curriculum.levels[{index}] = {level!r}: without data.curriculum.column each level is a "
                    "mapping of task options; set column to read the levels from a data column"
                )
            if self.column is not None and isinstance(level, dict) and not set(level) <= {"min", "max"}:
                raise ValueError(
                    f"data.curriculum.levels[{index}] = {level!r}: a range of column {self.column!r} is "
                    "{min: ..., max: ...}"
                )
        return self

    def level_of(self, row: dict[str, Any]) -> int | None:
        """The first level ``row`` belongs to (None: none, the row is never drawn)."""
        if self.column is None:
            return row.get(LEVEL_COLUMN)
        value = row.get(self.column)
        return next((i for i, level in enumerate(self.levels) if _matches(value, level)), None)


def _matches(value: Any, level: Any) -> bool:
    if isinstance(level, dict):  # a range, ends included
        try:
            return ("min" not in level or value >= level["min"]) and ("max" not in level or value <= level["max"])
        except TypeError:  # a value that does not compare with the range's ends (None, a string)
            return False
    if isinstance(level, list):
        return value in level
    return value == level


def row_levels(rows: Sequence[dict[str, Any]], section: CurriculumSection) -> list[int | None]:
    """Each row's level (:meth:`CurriculumSection.level_of`)."""
    return [section.level_of(row) for row in rows]


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
