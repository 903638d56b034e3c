"""ReMax's greedy baseline (docs/algorithms.md §2.5) over any sampling source.

``algorithm.baseline: greedy`` (a baseline the source plays: ``algos.BASELINES``) gives every
sample of a group the score of one greedy sample of the group's prompt: a greedy completion
scored by the same rewards, or a greedy episode of the same row (its return). The estimator
then reads it as ``baseline_scores``; NaN where the greedy sample has no score (the loop drops
that group rather than compare with 0)."""

from __future__ import annotations

import time

from posttrain.rollout.batch import RolloutBatch
from posttrain.sources.wrapper import SourceWrapper


class GreedyBaseline(SourceWrapper):
    """Sets ``baseline_scores`` of the step's batch from ``greedy_scores`` of the source under it."""

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics = self.inner.next_batch(step)
        if len(batch):
            t0 = time.perf_counter()
            batch.baseline_scores = self.inner.greedy_scores(batch)
            metrics["time/baseline_s"] = time.perf_counter() - t0
        return batch, metrics
