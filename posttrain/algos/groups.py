"""Per-group statistics for group-relative advantages (docs/algorithms.md §2.0).

Responses sampled from one prompt share a ``group_id``. Groups are found by id, never by
position: they need not be contiguous or of equal size, and a batch need not be a
multiple of the group size (DAPO's filtered batches, uneven data-parallel shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

SingletonMode = Literal["raw", "zero"]
SINGLETON_MODES: tuple[SingletonMode, ...] = ("raw", "zero")


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's own group, gathered back to ``[B]``."""

    mean: Tensor  # μ_g of the sample's group
    centred: Tensor  # r_i − μ_g, exactly 0 when the whole group holds one value
    std: Tensor  # unbiased σ_g (n−1); exactly 0 for a constant group or a singleton
    size: Tensor  # k, the number of samples in the group (float)


def group_stats(scores: Tensor, group_ids: Tensor) -> GroupStats:
    """μ_g, unbiased σ_g and k for every sample's group. Shapes: scores, group_ids ``[B]``."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be [B]; got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = scores.new_zeros(num_groups)
    size = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / size
    # Σr/k need not round back to r (3 × 0.2 / 3 ≠ 0.2), so a constant group is detected
    # directly: its advantages must be exactly 0, not 1e-17 that eps-scaling could inflate.
    lowest = zeros.scatter_reduce(0, index, scores, "amin", include_self=False)
    highest = zeros.scatter_reduce(0, index, scores, "amax", include_self=False)
    constant = (lowest == highest)[index]
    centred = torch.where(constant, torch.zeros_like(scores), scores - mean[index])
    sq = zeros.index_add(0, index, centred * centred)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    return GroupStats(mean=mean[index], centred=centred, std=std[index], size=size[index])


def group_normalise(
    scores: Tensor,
    group_ids: Tensor,
    *,
    scale_by_std: bool,
    eps: float,
    singleton: SingletonMode = "raw",
) -> Tensor:
    """(r − μ_g) / (σ_g + eps) per sample (or r − μ_g without std scaling). Shape ``[B]``.

    ``singleton`` decides a group of one (docs/algorithms.md §10.2): ``"raw"`` treats it as
    μ = 0, σ = 1 and keeps the raw reward (verl's loop implementations, our default, so a
    lone sample still teaches something); ``"zero"`` gives it no advantage (TRL, verl's
    vectorised RLOO).
    """
    check_singleton_mode(singleton)
    stats = group_stats(scores, group_ids)
    centred = stats.centred
    if scale_by_std:
        centred = centred / (stats.std + eps)
    lone = stats.size == 1
    lone_value = scores if singleton == "raw" else torch.zeros_like(scores)
    return torch.where(lone, lone_value, centred)


def check_singleton_mode(singleton: str) -> None:
    if singleton not in SINGLETON_MODES:
        raise ValueError(f"unknown singleton mode {singleton!r}; valid modes: {', '.join(SINGLETON_MODES)}")


def sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """r_i = Σ_t m·token_rewards[i, t]: one scalar per response, ``[B, T] -> [B]``.

    docs/algorithms.md §0 sums every position; we sum valid positions only, so that a value left
    on a padding or observation token is ignored here exactly as GAE and the returns-to-go
    estimators ignore it. With rewards on the last valid token (the convention) both agree.
    """
    return torch.where(response_mask.bool(), token_rewards, torch.zeros_like(token_rewards)).sum(-1)


def broadcast_to_tokens(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """``[B] -> [B, T]``: the value on every valid token, 0 elsewhere."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)
