"""DAPO's dynamic sampling (docs/algorithms.md §7.1) over any sampling source.

Groups whose scores are all equal give a group-relative estimator nothing to learn (every
advantage is 0; with a critic, no signal beyond its values), so they are dropped and further
rows drawn, up to ``max_rounds`` draws a step, until ``prompts_per_step`` groups with spread
are kept. Groups are single-turn completions of a prompt or episodes of a row alike; a group's
spread is judged on its scored samples only. The step's metrics are those of its first draw
(what the policy does), plus the rounds it took and the groups kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from posttrain.algos.sampling import dapo_group_filter
from posttrain.config import Section
from posttrain.rollout.batch import RolloutBatch, concat
from posttrain.sources.wrapper import SourceWrapper

SUMMED = ("time/generate_s", "time/reward_s", "time/env_s")  # what the further draws add to the step's figures


class DynamicSamplingSection(Section):
    """DAPO dynamic sampling (docs/algorithms.md §7.1)."""

    enabled: bool = False
    """Drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_rounds: int = Field(4, ge=1)
    """Generation rounds per step at most; then train on what was kept (a warning says so)."""


class DynamicSampling(SourceWrapper):
    """Keeps drawing until ``groups`` groups with spread are kept (see the module docstring):
    this process's share of a draw of ``prompts_per_step`` rows (every rank's together)."""

    def __init__(
        self,
        inner: Any,
        section: DynamicSamplingSection,
        prompts_per_step: int,
        groups: int,
        echo: Callable[[str], None] = print,
    ) -> None:
        super().__init__(inner)
        self.max_rounds, self.prompts_per_step, self.groups, self.echo = (
            section.max_rounds,
            prompts_per_step,
            groups,
            echo,
        )

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        kept: list[RolloutBatch] = []
        kept_groups, drawn, metrics, draw = 0, 0, {}, None
        for round_index in range(self.max_rounds):
            batch, round_metrics = self.inner.sample(step, round_index, group_offset=drawn)
            drawn += self.prompts_per_step  # the next draw's groups are numbered after every rank's of this one
            if round_index == 0:  # the step's draw, before any group is dropped
                draw, metrics = batch, dict(round_metrics)
            else:
                for key in SUMMED:
                    if key in round_metrics:
                        metrics[key] = metrics.get(key, 0.0) + round_metrics[key]
            batch = batch.select(torch.nonzero(groups_with_signal(batch)).flatten())
            kept.append(batch)
            kept_groups += int(batch.group_ids.unique().numel())
            if kept_groups >= self.groups:
                break
        batch = concat(kept, self.inner.pad_id)
        groups = batch.group_ids.unique(sorted=False)[: self.groups]
        none_kept = groups.numel() == 0
        # none kept: the step trains on its draw as without dynamic sampling, whose advantages
        # are all 0 (a step that trains no sample), rather than on an empty batch
        batch = draw if none_kept else batch.select(torch.nonzero(torch.isin(batch.group_ids, groups)).flatten())
        metrics["dynamic_sampling/rounds"] = round_index + 1
        metrics["dynamic_sampling/kept_groups"] = float(groups.numel())
        if groups.numel() < self.groups and step % 10 == 1:
            self.echo(
                f"[warning] step {step}: dynamic sampling kept {groups.numel()} of {self.groups} groups after "
                f"{self.max_rounds} rounds; training on {'the first draw' if none_kept else 'what was kept'} "
                "(raise algorithm.dynamic_sampling.max_rounds)"
            )
        return batch, metrics


def groups_with_signal(batch: RolloutBatch) -> Tensor:
    """``[B]`` keep mask of DAPO's dynamic sampling, judged on the scored samples only: a
    missing score read as 0 would make [1, 1, None, 1] look like a group with signal. Unscored
    samples of a kept group stay (the loop's batch preparation drops and counts them)."""
    scored = ~batch.scores.isnan()
    keep = dapo_group_filter(batch.scores[scored], batch.group_ids[scored])
    return torch.isin(batch.group_ids, batch.group_ids[scored][keep])
