"""The reward summary of every draw: ``reward/*`` and ``response/*`` metrics, for single-turn
completions and environment episodes alike.

:class:`ScoreMetrics` wraps a sampling source right above the shaping of its scores (overlong
shaping), so the figures are those of the scores trained on, and keeps the lowest score seen in
the run (checkpointed as ``lowest_score``, the key runs have always used)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from posttrain.algos import group_stats
from posttrain.rollout.batch import RolloutBatch
from posttrain.sources.wrapper import SourceWrapper


class ScoreMetrics(SourceWrapper):
    """Adds :func:`reward_metrics` of every draw to its metrics (the source's own figures win:
    an environment counts truncation per turn)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        # the lowest score seen in the run: a batch whose every score is the best one is "every
        # prompt learned" only if lower scores were ever seen (else the reward may be constant)
        self.lowest_score = math.inf

    def sample(self, step: int, round_index: int = 0, group_offset: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics = self.inner.sample(step, round_index, group_offset)
        summary, self.lowest_score = reward_metrics(batch, self.inner.single_reward, self.lowest_score)
        return batch, {**summary, **metrics}

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "lowest_score": self.lowest_score}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.lowest_score = float(state.get("lowest_score", math.inf))  # absent before session 26
        return self.inner.load_state_dict(state)


def _zero_variance_shares(
    std: Tensor, size: Tensor, scores: Tensor, group_ids: Tensor, lowest_seen: float
) -> tuple[float, float]:
    """(share of groups of more than one sample whose rewards are all equal, share of those
    equal groups sitting at the batch's highest reward — prompts the policy has learned).

    "Learned" needs a reward that has been lower before (``lowest_seen``, over the run): a
    reward that is constant (or went flat) gives batches whose every score is the batch's best,
    and reading those as every prompt learned would silence the warnings about it; a policy
    that solves every prompt of a batch after earlier failures has learned them."""
    _, first = torch.unique(group_ids, return_inverse=True)
    best = float(scores.max())
    spread = lowest_seen < best
    equal: dict[int, bool] = {}
    solved: dict[int, bool] = {}
    for index, group in enumerate(first.tolist()):
        if group not in equal and int(size[index]) > 1:
            equal[group] = bool(std[index] == 0)
            solved[group] = equal[group] and spread and float(scores[index]) == best
    zero = sum(equal.values())
    return zero / max(len(equal), 1), sum(solved.values()) / max(zero, 1)


def reward_metrics(batch: RolloutBatch, single_reward: bool, lowest_seen: float) -> tuple[dict[str, float], float]:
    """The step's ``reward/*`` and ``response/*`` metrics of a scored batch, and the lowest score
    seen in the run so far (``lowest_seen`` updated; see :func:`_zero_variance_shares`).
    ``reward/accuracy`` only for a single 0/1 reward: a sum of several that happens to be 0/1
    is no accuracy. Response lengths count the policy's tokens (``response_mask``)."""
    scores = batch.scores
    present = ~scores.isnan()
    valid = scores[present]
    lengths = batch.response_mask.sum(-1)
    metrics = {
        "reward/mean": float(valid.mean()) if valid.numel() else math.nan,
        "reward/std": float(valid.std(unbiased=False)) if valid.numel() else math.nan,
        "reward/none_fraction": 1.0 - float(present.float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": float(batch.truncated.float().mean()),
    }
    if single_reward and valid.numel() and bool(((valid == 0) | (valid == 1)).all()):
        metrics["reward/accuracy"] = float(valid.mean())
    if present.any():
        stats = group_stats(valid, batch.group_ids[present])
        lowest_seen = min(lowest_seen, float(valid.min()))
        zero, at_max = _zero_variance_shares(stats.std, stats.size, valid, batch.group_ids[present], lowest_seen)
        metrics["reward/zero_variance_group_fraction"] = zero
        metrics["reward/zero_variance_at_max_fraction"] = at_max
    return metrics, lowest_seen
