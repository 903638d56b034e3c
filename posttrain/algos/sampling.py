"""DAPO's data-side techniques: dynamic sampling and overlong reward shaping (docs/algorithms.md §7)."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algos.groups import group_stats


def dapo_group_filter(group_metric: Tensor, group_ids: Tensor) -> Tensor:
    """Dynamic sampling: keep mask ``[B]`` dropping every group whose metric does not vary.

    A group whose metric (accuracy, or the summed reward) has population std 0 — all correct
    or all wrong — gives every member a zero group-relative advantage, so it only dilutes the
    batch. Singleton groups are kept (there is nothing to compare them with). Refilling the
    batch from further generation rounds is the loop's job. Source: Yu et al., "DAPO: An
    Open-Source LLM Reinforcement Learning System at Scale", 2025, eq. 11 / §3.2.
    """
    stats = group_stats(group_metric.to(torch.float64), group_ids)
    # unbiased std is 0 exactly when the population std is; exact comparison is safe because
    # the two-pass variance of identical values is exactly 0
    return (stats.std > 0) | (stats.size == 1)


def overlong_reward_penalty(lengths: Tensor, max_length: int, cache_length: int, factor: float = 1.0) -> Tensor:
    """Soft overlong punishment R_len(L) added to the task reward, ``[B] -> [B]``.

        L_exp = L_max − L_cache
        R_len = 0                             if L ≤ L_exp
              = (L_exp − L)/L_cache·factor    if L_exp < L ≤ L_max   (linear 0 → −factor)
              = −factor                       if L > L_max

    Paper: L_max = 20480, L_cache = 4096, factor 1. Source: Yu et al., "DAPO", 2025, eq. 13.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}")
    expected = max_length - cache_length
    lengths = lengths.to(torch.get_default_dtype()) if not lengths.is_floating_point() else lengths
    linear = (expected - lengths) / cache_length * factor
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), linear)
    return torch.where(lengths > max_length, torch.full_like(lengths, -factor), penalty)
