"""A resumable, seeded order over a dataset's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.data.curriculum import CurriculumSection, row_levels
from posttrain.data.loading import DataError


class EpochSampler:
    """Yields index batches; each epoch is a fresh permutation drawn from ``seed + epoch``.

    The whole state is ``(epoch, position)``, so a resumed run regenerates the exact same
    order from the checkpoint without storing it, whatever else touched the global RNG. The
    short remainder of an epoch is dropped so every batch has ``batch_size`` rows.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int) -> None:
        if num_rows < batch_size:
            # a PosttrainError: rows left out after loading (too long for the context) can get here
            raise DataError(f"{num_rows} usable rows cannot fill one batch of {batch_size}; lower the batch size")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def observe(self, scores: torch.Tensor, ranks: Any) -> dict[str, float]:
        """A step's scores, which only a curriculum acts on: no metrics."""
        return {}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()


class CurriculumSampler:
    """:class:`EpochSampler`'s interface over the rows of the current level of ``data.curriculum``,
    which advances as :meth:`observe` sees each step's scores (posttrain/data/curriculum.py)."""

    def __init__(self, levels: Sequence[int | None], batch_size: int, seed: int, section: CurriculumSection) -> None:
        self.section = section
        self.rows_of = [[i for i, level in enumerate(levels) if level == n] for n in range(len(section.levels))]
        for level, rows in enumerate(self.rows_of):
            if len(rows) < batch_size:
                where = (
                    f"rows whose {section.column!r} is {section.levels[level]!r}" if section.column else "usable rows"
                )
                raise DataError(
                    f"data.curriculum level {level} has {len(rows)} {where}, fewer than one step's batch "
                    f"({batch_size}): add rows of that level, merge levels or lower prompts_per_step"
                )
        self.samplers = [EpochSampler(len(rows), batch_size, seed + n) for n, rows in enumerate(self.rows_of)]
        self.level = 0
        self.recent: list[float] = []
        self.advancing = False  # observe() reached advance_at: the next step draws from the next level

    def start_step(self) -> None:
        """Called before a step's first draw: move to the next level if the last step earned it.
        A step's every draw (dynamic sampling's further ones too) is of one level."""
        if self.advancing:
            self.level, self.recent, self.advancing = self.level + 1, [], False

    def next_batch(self) -> list[int]:
        rows = self.rows_of[self.level]
        return [rows[i] for i in self.samplers[self.level].next_batch()]

    def observe(self, scores: torch.Tensor, ranks: Any) -> dict[str, float]:
        """Record the share of a step's samples (every rank's: ``ranks`` is the run's
        :class:`~posttrain.distributed.World`) whose score passed; move to the next level when
        the window's mean reaches ``advance_at`` (from the next step on: :meth:`start_step`). The
        step's ``curriculum/*`` metrics (the level it drew from and its pass rate)."""
        passed = ranks.sum(float((scores >= self.section.pass_score).sum()))  # NaN (no score) fails
        pass_rate = passed / max(ranks.sum(float(scores.numel())), 1.0)
        metrics = {"curriculum/level": float(self.level), "curriculum/pass_rate": pass_rate}
        self.recent = [*self.recent, pass_rate][-self.section.window :]
        ready = len(self.recent) == self.section.window and self.level + 1 < len(self.rows_of)
        self.advancing = ready and sum(self.recent) / len(self.recent) >= self.section.advance_at
        return metrics

    def state_dict(self) -> dict[str, Any]:
        # a pending advance is taken now: the level the next step draws from (as checkpoints always held)
        level, recent = (self.level + 1, []) if self.advancing else (self.level, list(self.recent))
        return {"level": level, "recent": recent, "levels": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "levels" not in state:
            raise DataError("the checkpoint was saved without data.curriculum; remove it or start a new run")
        self.level, self.recent = int(state["level"]), [float(r) for r in state["recent"]]
        self.advancing = False
        for sampler, saved in zip(self.samplers, state["levels"], strict=True):
            sampler.load_state_dict(saved)


def curriculum_sampler(
    rows: Sequence[dict[str, Any]], batch_size: int, seed: int, curriculum: CurriculumSection
) -> CurriculumSampler:
    """The order of ``rows`` by the levels of ``data.curriculum`` (each row's: ``row_levels``)."""
    return CurriculumSampler(row_levels(rows, curriculum), batch_size, seed, curriculum)
