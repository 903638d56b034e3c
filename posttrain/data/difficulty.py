"""Difficulty filtering of RL prompts: keep those the starting policy solves only sometimes.

A group-relative estimator (GRPO, RLOO, ...) learns nothing from a prompt whose samples all pass
or all fail: every advantage is 0. Before training, ``data.filter`` samples ``k`` completions of
every training prompt from the starting policy, scores them with the run's rewards, and keeps the
prompts whose pass rate (the share of samples scoring at least ``threshold``) lies in
``pass_rate: [low, high]`` — the offline form of DAPO's dynamic sampling (Yu et al., 2025), as
in the difficulty filtering of Polaris and Skywork-OR1.

The measured rates are written to ``data_filter.json`` in the run folder (with the kept rows and
a histogram), so a resumed run trains on the same prompts without measuring again (the policy has
moved since) and a user can see which were kept; the run prints the kept share and histogram.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from posttrain.data.loading import DataError

FILTER_FILE = "data_filter.json"


@dataclass
class DifficultyFilter:
    """The measured pass rate of every training row and which rows were kept."""

    k: int
    low: float
    high: float
    threshold: float
    rates: list[float]
    """Per training row (in data order), the share of its k samples that passed."""

    @property
    def kept(self) -> list[int]:
        return [i for i, rate in enumerate(self.rates) if self.low <= rate <= self.high]

    def histogram(self) -> dict[str, int]:
        """Rows per number of passed samples, ``"0/k"`` .. ``"k/k"``."""
        counts = Counter(round(rate * self.k) for rate in self.rates)
        return {f"{passed}/{self.k}": counts.get(passed, 0) for passed in range(self.k + 1)}

    def summary(self) -> str:
        bars = ", ".join(f"{label}: {count}" for label, count in self.histogram().items())
        return (
            f"kept {len(self.kept)} of {len(self.rates)} prompts whose pass rate over {self.k} samples lies in "
            f"[{self.low:g}, {self.high:g}] (rows per passed samples: {bars})"
        )

    def same_settings(self, other: DifficultyFilter) -> bool:
        return (self.k, self.low, self.high, self.threshold, len(self.rates)) == (
            other.k,
            other.low,
            other.high,
            other.threshold,
            len(other.rates),
        )

    def save(self, run_dir: Path) -> None:
        record = {**asdict(self), "kept": self.kept, "histogram": self.histogram()}
        (run_dir / FILTER_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, run_dir: Path) -> DifficultyFilter | None:
        path = run_dir / FILTER_FILE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{key: record[key] for key in ("k", "low", "high", "threshold", "rates")})
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(
                f"{path} is not a readable difficulty filter ({error}); delete it to measure the prompts again"
            ) from None


def pass_rates(scores: Sequence[Sequence[float]], k: int, threshold: float) -> list[float]:
    """Per prompt, the share of its ``k`` samples scoring at least ``threshold`` (a sample the
    reward did not score counts as not passed)."""
    return [sum(score >= threshold for score in row) / k for row in scores]


def filter_rows(
    rows: Sequence[dict[str, Any]],
    settings: Any,
    measure: Callable[[Sequence[dict[str, Any]], int], Sequence[Sequence[float]]],
    run_dir: Path,
    resuming: bool,
) -> tuple[list[dict[str, Any]], DifficultyFilter]:
    """(the kept rows, the filter). ``settings`` is the config's ``data.filter``; ``measure(rows,
    k)`` samples and scores k completions of each row with the starting policy. A resumed run
    reads the rates its first start measured (the same settings are required)."""
    low, high = settings.pass_rate
    wanted = DifficultyFilter(settings.k, low, high, settings.threshold, [0.0] * len(rows))
    cached = DifficultyFilter.load(run_dir) if resuming else None
    if cached is not None and not cached.same_settings(wanted):
        raise DataError(
            f"{run_dir / FILTER_FILE} was measured with k={cached.k}, pass_rate=[{cached.low:g}, {cached.high:g}], "
            f"threshold={cached.threshold:g} over {len(cached.rates)} rows; the config now asks for k={wanted.k}, "
            f"[{low:g}, {high:g}], threshold={wanted.threshold:g} over {len(rows)} rows: resume with the run's own "
            "data and data.filter, or start a new run"
        )
    result = cached
    if result is None:
        rates = pass_rates(measure(rows, settings.k), settings.k, settings.threshold)
        result = DifficultyFilter(settings.k, low, high, settings.threshold, rates)
    return [rows[i] for i in result.kept], result
