"""Masked statistics, whitening and loss aggregation (docs/algorithms.md §1).

Every token tensor is ``[B, T]`` over response positions with a 0/1 ``mask`` of the same
shape. Zeros may sit anywhere (right padding, and tool/environment tokens inside
multi-turn responses), so nothing here assumes a row's valid tokens are contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ m·x over `dim` (all elements when None). ``where`` keeps NaN/inf in masked slots out."""
    masked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """mean_m(x) = Σ m·x / max(Σ m, 1)  (docs/algorithms.md §1.1); 0 where nothing is valid."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all valid elements: Σ m·(x − mean_m)² / (Σ m − 1), or ÷ Σ m if not unbiased.

    Unbiased needs at least 2 valid elements; with fewer the variance is reported as 0
    (a single sample carries no spread) rather than NaN.
    """
    mean = masked_mean(x, mask)
    count = mask.to(x.dtype).sum()
    denom = count - 1 if unbiased else count
    return masked_sum((x - mean) ** 2, mask) / denom.clamp(min=1)


def masked_whiten(
    x: Tensor, mask: Tensor, *, unbiased: bool = True, eps: float = 1e-8, shift_mean: bool = True
) -> Tensor:
    """whiten_m(x) = (x − mean_m(x)) / sqrt(var_m(x) + eps), zero where mask == 0.

    Statistics are token-weighted over every valid element of the batch, as verl and
    OpenRLHF whiten advantages (docs/algorithms.md §1.1). ``unbiased=False`` is OpenRLHF's
    variance; ``shift_mean=False`` rescales without centring (verl's option).
    """
    mean = masked_mean(x, mask)
    scaled = (x - mean) * torch.rsqrt(masked_var(x, mask, unbiased=unbiased) + eps)
    if not shift_mean:
        scaled = scaled + mean
    return torch.where(mask.bool(), scaled, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``L [B, T]`` to a scalar (docs/algorithms.md §1.2).

    With ``S_i = Σ_t m·L`` and ``B'`` the number of rows with at least one valid token:

    * ``token-mean``:              Σ_i S_i / N_tok        (verl default, DAPO)
    * ``token-sum``:               Σ_i S_i                (CartPole REINFORCE)
    * ``seq-mean-token-sum``:      Σ_i S_i / B'
    * ``seq-mean-token-mean``:     (1/B') Σ_i S_i / n_i   (GRPO, GSPO, SAPO papers)
    * ``seq-mean-token-sum-norm``: Σ_i S_i / (B'·C)       (Dr. GRPO; Liu et al. 2025)

    Under gradient accumulation or data parallelism pass the *global* ``num_tokens`` /
    ``num_seqs`` of the optimizer step so the result is a true mean over the step rather
    than a per-micro-batch one. ``norm_constant`` is Dr. GRPO's C: set it to the maximum
    generation length. When left None it falls back to the padded width T — verl's
    default, which varies between batches and so reintroduces a weak length bias.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}")
    per_seq_sum = masked_sum(per_token, mask, dim=-1)
    if mode == "token-sum":
        return per_seq_sum.sum()
    if mode == "token-mean":
        count = mask.to(per_token.dtype).sum() if num_tokens is None else num_tokens
        return per_seq_sum.sum() / _at_least_one(count, per_token)
    tokens_per_seq = mask.to(per_token.dtype).sum(-1)
    seqs = (tokens_per_seq > 0).to(per_token.dtype).sum() if num_seqs is None else num_seqs
    seqs = _at_least_one(seqs, per_token)
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / tokens_per_seq.clamp(min=1)).sum() / seqs
    constant = float(per_token.shape[-1]) if norm_constant is None else float(norm_constant)
    if constant <= 0:
        raise ValueError(f"norm_constant must be positive (the maximum response length), got {constant}")
    return per_seq_sum.sum() / (seqs * constant)


def _at_least_one(count: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
