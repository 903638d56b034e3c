"""``data.filter`` over any sampling source: keep the training rows the starting policy solves
only sometimes (``data/difficulty.py`` holds the rule and its record, data_filter.json).

Before training, ``k`` samples of every row are measured by the run's evaluation (its
``measure(rows, k)``): single-turn completions scored by the run's rewards, or environment
episodes (their returns). Rows whose pass rate lies outside ``pass_rate`` are dropped before the
source is built, so they are never drawn; a resumed run reads the rates its first start measured."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator

from posttrain.config import Section
from posttrain.data.difficulty import DifficultyFilter, filter_rows
from posttrain.data.loading import DataError


class DataFilterSection(Section):
    """Keep the prompts the starting policy solves only sometimes (data/difficulty.py)."""

    pass_rate: tuple[Annotated[float, Field(ge=0, le=1)], Annotated[float, Field(ge=0, le=1)]]
    """[low, high]: keep a prompt when the share of its k samples that pass lies in this range,
    ends included; e.g. [0.1, 0.9] with k 8 keeps prompts solved 1 to 7 times out of 8."""
    k: int = Field(8, ge=1)
    """Samples per prompt (episodes per row with env), at the run's sampling temperature and max_new_tokens."""
    threshold: float = 1.0
    """A sample passes when the run's (weighted) reward scores it at least this (an episode: its return)."""

    @model_validator(mode="after")
    def _ordered(self) -> DataFilterSection:
        low, high = self.pass_rate
        if low > high:
            raise ValueError(f"data.filter.pass_rate = [{low:g}, {high:g}]: low must not exceed high")
        return self


def filter_by_difficulty(
    evaluation: Any,
    rows: Sequence[dict[str, Any]],
    section: DataFilterSection,
    run_dir: Path,
    resuming: bool,
    prompts_per_step: int,
    echo: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], DifficultyFilter]:
    """(the kept rows, the filter): ``evaluation.measure`` samples k of each row from the starting
    policy; too few rows left for one step is a data error saying what to change."""
    kept, result = filter_rows(rows, section, evaluation.measure, run_dir, resuming)
    echo(f"[data] difficulty filter: {result.summary()}")
    if len(kept) < prompts_per_step:
        raise DataError(
            f"data.filter kept {len(kept)} prompts, fewer than prompts_per_step = {prompts_per_step}: "
            f"{result.summary()}; widen data.filter.pass_rate, raise data.filter.k, or add data"
        )
    return kept, result
