"""``data.curriculum`` over any sampling source (``data/curriculum.py`` says what the levels are).

The wrapper replaces the source's row order with the curriculum's (the rows of the current
level) and shows it the scores of every step's first draw: its pass rate advances the level from
the next step on (a step's draws, dynamic sampling's further ones too, are all of one level).
Under ``rollout.max_staleness`` it sits inside the asynchronous producer, so the level advances
on the batches produced, in step order: a run repeats exactly, and a checkpoint holds the level
the next produced batch draws from (the sampler's state, ``sampler`` in the training state)."""

from __future__ import annotations

from typing import Any

from posttrain.data.curriculum import CurriculumSection
from posttrain.data.sampler import curriculum_sampler
from posttrain.distributed import world
from posttrain.rollout.batch import RolloutBatch
from posttrain.sources.wrapper import SourceWrapper


class Curriculum(SourceWrapper):
    """Draws from the current level; the first draw of each step advances it (``curriculum/*`` metrics)."""

    def __init__(self, inner: Any, section: CurriculumSection, prompts_per_step: int, seed: int) -> None:
        super().__init__(inner)
        self.sampler = curriculum_sampler(inner.rows, prompts_per_step, seed, section)
        self.ranks = world()  # every rank's samples count toward the pass rate

    def sample(self, step: int, round_index: int = 0, group_offset: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        if round_index == 0:  # a level earned by the last step applies from this step's first draw
            self.sampler.start_step()
        batch, metrics = self.inner.sample(step, round_index, group_offset)
        if round_index == 0:  # the step's draw, as the policy does (dynamic sampling's further draws are not)
            metrics.update(self.sampler.observe(batch.scores, self.ranks))
        return batch, metrics
