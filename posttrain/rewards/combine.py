"""How the scores of several reward functions become one reward per sample, and when a
missing score stops the run.

A reward function says "no score" for a sample by returning ``None`` (or NaN, which is read
the same way but warned about, see ``compose.py``); a sample also has no score from a
function whose call timed out or whose worker crashed. The rule, for sample i of prompt g:

- reward k *applies* to prompt g when it scored at least one sample of g in this batch. One
  that scored none of g's samples says the prompt is not its business (TRL's multi-task
  pattern: a math reward returns None for every code row) and is left out of g's sum;
- i's reward is ``Σ_{k applies to g} w_k·r_ik``, and missing (NaN: the sample is masked out of
  the update, never trained with a made-up value) when any such r_ik is missing, when one of
  i's calls timed out or crashed, or when no reward applies. A weight-0 reward (a monitor)
  never masks a sample.

So a missing score is never read as 0: in a sum ``w_1·r_1 + w_2·r_2`` a sample whose r_1 is
missing is not scored ``w_2·r_2`` while the others of its prompt are scored with both.

A function's *failed* samples are those it gave no score where it applies, plus its timeouts
and crashes; when more than ``max_failed_fraction`` of a batch's samples failed, the run stops
(:func:`failed_share_message`) instead of training on what is left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

DEFAULT_MAX_FAILED_FRACTION = 0.5
"""Share of a batch's samples one reward function may leave unscored before the run stops."""


def prompt_groups(prompts: Sequence[Any]) -> Tensor:
    """``[B]`` group ids: samples with the same prompt (text or messages) share one."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(repr(p), len(ids)) for p in prompts], dtype=torch.long)


def reward_applies(components: Tensor, group_ids: Tensor) -> Tensor:
    """``[B, K]`` bool: reward k scored at least one sample of sample i's group.
    ``components [B, K]`` (NaN: no score), ``group_ids [B]``."""
    present = ~components.isnan()
    if components.shape[0] == 0:
        return present
    _, index = torch.unique(group_ids, return_inverse=True)
    counts = torch.zeros(int(index.max()) + 1, components.shape[1]).index_add(0, index, present.float())
    return (counts > 0)[index]


def unscored(components: Tensor, applies: Tensor, failed: Tensor) -> Tensor:
    """``[B, K]`` bool: sample i has no score from reward k where k should have given one."""
    return failed | (applies & components.isnan())


def combine(components: Tensor, weights: Tensor, applies: Tensor, failed: Tensor) -> Tensor:
    """``[B]`` Σ_k w_k·r_ik over the rewards that apply; NaN where one of them (of non-zero
    weight) has no score for the sample, or none applies. Shapes: components, applies,
    failed ``[B, K]``; weights ``[K]``."""
    counted = weights != 0
    used = applies & ~components.isnan()
    missing = (unscored(components, applies, failed) & counted).any(-1) | ~used.any(-1)
    total = torch.where(used, components * weights, torch.zeros_like(components)).sum(-1)
    return torch.where(missing, torch.full_like(total, math.nan), total)


def failed_share_message(
    name: str, failed: int, size: int, limit: float, *, timeouts: int, crashes: int, timeout_s: float | None
) -> str | None:
    """Why the run stops when reward ``name`` left more than ``limit`` of ``size`` samples
    unscored (how they failed, what to do); None when it did not."""
    if size == 0 or failed / size <= limit:
        return None
    others = failed - timeouts - crashes
    how = f"{timeouts} timed out" + (f" after {timeout_s:g} s" if timeouts and timeout_s else "")
    how += f", {crashes} crashed (the worker died), {others} None/NaN where it scores other samples of the prompt"
    return (
        f"reward function {name!r} gave no score for {failed} of {size} samples of this batch ({how}), more than "
        f"max_failed_fraction={limit:g}; training on the rest would learn from a biased share of the batch. Fix "
        f"the function (see the warnings above), give it more time (its entry's 'timeout'), or allow it: "
        f"{{name: ..., max_failed_fraction: 1}} in its rewards entry, or reward_max_failed_fraction for all"
    )
