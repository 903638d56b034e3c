"""DAPO's soft overlong punishment (docs/algorithms.md §7.2) over any sampling source.

Every draw's scores get R_len(L) added (``algos.overlong_reward_penalty``), L the tokens the
policy sampled for the sample: a completion's length, or an episode's sampled tokens over all
its turns (its ``response_mask``; the environment's tokens between turns are not the policy's).
L_max is ``algorithm.overlong.max_length``, by default the most a sample can sample: the
source's ``length_limit`` (``max_new_tokens``, or ``env.max_turns × max_new_tokens``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from posttrain.algos import overlong_reward_penalty
from posttrain.config import Section
from posttrain.rollout.batch import RolloutBatch
from posttrain.sources.wrapper import SourceWrapper


class OverlongSection(Section):
    """DAPO's soft overlong punishment (docs/algorithms.md §7.2); off unless `enabled`."""

    enabled: bool = False
    """Add R_len(L) to the reward of each sample."""
    cache_length: int = Field(4, ge=1)
    """L_cache: the penalty ramps from 0 to −factor over the last `cache_length` tokens before
    the limit."""
    factor: float = Field(1.0, ge=0)
    """Penalty at the hard limit."""
    max_length: int | None = Field(None, ge=1)
    """L_max, in sampled tokens; null: max_new_tokens for single-turn completions,
    env.max_turns × max_new_tokens for environment episodes."""


class OverlongShaping(SourceWrapper):
    """Adds R_len of each sample's sampled tokens to its score (see the module docstring)."""

    def __init__(self, inner: Any, section: OverlongSection) -> None:
        super().__init__(inner)
        self.section = section
        self.max_length = section.max_length if section.max_length is not None else inner.length_limit

    def sample(self, step: int, round_index: int = 0, group_offset: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics = self.inner.sample(step, round_index, group_offset)
        section = self.section
        lengths = batch.response_mask.sum(-1)
        penalty = overlong_reward_penalty(lengths, self.max_length, section.cache_length, section.factor)
        batch.scores = batch.scores + penalty  # a NaN score (no reward, an error) stays NaN
        return batch, metrics
