"""The critic's clipped value loss (docs/algorithms.md §4.9)."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algos.masked import aggregate_loss, masked_mean, masked_var

VALUE_LOSS_KINDS = ("mse", "huber")


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range: float | None = 0.5,
    kind: str = "mse",
    huber_delta: float = 10.0,
    agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value regression onto the GAE returns R.

        v_clip = v_old + clip(v − v_old, −c, c)
        loss   = 0.5·agg(max((v − R)², (v_clip − R)²))

    ``clip_range=None`` drops the clipped term; ``kind="huber"`` replaces the squares by
    Huber terms (δ = 10, AReaL; without the 0.5). Metrics: ``clip_fraction`` =
    mean_m[(v_clip − R)² > (v − R)²], ``explained_variance`` of R by v.
    Shapes ``[B, T]``. Source: Schulman et al., "Proximal Policy Optimization Algorithms",
    2017 (the clipped term comes from the reference implementation, not the paper).
    """
    if kind not in VALUE_LOSS_KINDS:
        raise ValueError(f"unknown value loss kind {kind!r}; valid: {', '.join(VALUE_LOSS_KINDS)}")

    def error(prediction: Tensor) -> Tensor:
        if kind == "mse":
            return 0.5 * (prediction - returns) ** 2
        return torch.nn.functional.huber_loss(prediction, returns, reduction="none", delta=huber_delta)

    unclipped = error(values)
    if clip_range is None:
        per_token, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_error = error(clipped_values)
        per_token, clipped = torch.maximum(unclipped, clipped_error), clipped_error > unclipped
    loss = aggregate_loss(per_token, response_mask, agg_mode)
    with torch.no_grad():
        residual_var = masked_var(returns - values, response_mask, unbiased=False)
        returns_var = masked_var(returns, response_mask, unbiased=False)
        metrics = {
            "clip_fraction": masked_mean(clipped.to(values.dtype), response_mask),
            "explained_variance": 1.0 - residual_var / returns_var.clamp(min=1e-8),
        }
    return loss, metrics


EXPLAINED_VARIANCE_PARTS = ("count", "residual_sum", "residual_squares", "returns_sum", "returns_squares")


def explained_variance_parts(values: Tensor, returns: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Masked sums from which the explained variance of R by v follows (:func:`explained_variance_of`):
    summed over micro-batches (or ranks) they give the whole batch's, which a mean of the parts'
    own explained variances does not."""
    mask = response_mask.to(torch.float64)
    residual, target = (returns - values).detach().double() * mask, returns.detach().double() * mask
    sums = (mask.sum(), residual.sum(), (residual * residual).sum(), target.sum(), (target * target).sum())
    return {name: float(value) for name, value in zip(EXPLAINED_VARIANCE_PARTS, sums, strict=True)}


def explained_variance_of(parts: dict[str, float]) -> float:
    """1 − Var(R − v) / Var(R) from :func:`explained_variance_parts` (population variances)."""
    n = max(parts["count"], 1.0)
    residual_var = parts["residual_squares"] / n - (parts["residual_sum"] / n) ** 2
    returns_var = parts["returns_squares"] / n - (parts["returns_sum"] / n) ** 2
    return 1.0 - residual_var / max(returns_var, 1e-8)
