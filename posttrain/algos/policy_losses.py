"""Per-token policy losses (docs/algorithms.md §4.1–4.8), each aggregated with §1.2.

Every loss takes ``logprobs`` (ℓ, current policy, differentiable), ``old_logprobs`` (ℓ_old,
the policy that produced the data; for ``decoupled_ppo`` the behaviour policy),
``advantages`` and ``response_mask``, all ``[B, T]``. The functions below compute the
per-token loss L ``[B, T]`` and detached diagnostics (``clip_fraction``, ``approx_kl``, ...);
registration wraps each one so that ``POLICY_LOSSES[name](...)`` returns ``(loss, metrics)``
with L aggregated by ``agg_mode`` (default: the paper's mode, given at registration) and the
``num_tokens`` / ``num_seqs`` / ``norm_constant`` options of
:func:`posttrain.algos.masked.aggregate_loss`.

Log-ratio clamp (docs/algorithms.md §10.9): ℓ − ℓ_old is clamped to ±20 before ``exp`` (verl,
OpenRLHF) so one wild token cannot overflow; ``log_ratio_clamp=None`` removes it (TRL).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algos.masked import masked_mean
from posttrain.algos.registry import register_policy_loss

Metrics = dict[str, Tensor]


def _ratio(logprobs: Tensor, reference: Tensor, clamp: float | None) -> Tensor:
    log_ratio = logprobs - reference
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return torch.exp(log_ratio)


def _diagnostics(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, clipped: Tensor) -> Metrics:
    """clip_fraction = mean_m[clipped]; approx_kl = mean_m(ℓ_old − ℓ) (k1 of π_old‖π)."""
    with torch.no_grad():
        return {
            "clip_fraction": masked_mean(clipped.to(logprobs.dtype), mask),
            "approx_kl": masked_mean(old_logprobs - logprobs.detach(), mask),
        }


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, clip_c: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)), then the dual clip min(·, −c·A) for A < 0.

    Returns ``(per_token_loss, clipped, dual_clipped)``; the last two are boolean ``[B, T]``.
    """
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
        bound = -clip_c * advantages
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return loss, clipped, dual_clipped


@register_policy_loss("ppo_clip", agg_mode="token-mean")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_c: float | None = None,
    ratio_cap: float | None = None,
    weights: Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate with clip-higher, dual clip and optional IS weights.

        ρ_t = exp(ℓ_t − ℓ_old,t)
        L_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high))
        L_t ← min(L_t, −c·A_t)  where A_t < 0      (dual clip, only when ``clip_c`` is set)

    ``clip_high`` defaults to ``clip_low`` (symmetric PPO); DAPO's clip-higher uses 0.2/0.28.
    ``ratio_cap`` = TRL's δ (INTELLECT-2): ρ ← min(ρ, δ) inside the unclipped term.
    ``weights`` are detached per-token importance weights (e.g. truncated IS for rollout-engine
    mismatch) multiplying L_t. Sources: Schulman et al., "Proximal Policy Optimization
    Algorithms", 2017, eq. 7; dual clip: Ye et al., "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning", 2020, eq. 5; clip-higher: Yu et al., "DAPO", 2025, §3.1.
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp)
    if ratio_cap is not None:
        ratio = torch.minimum(ratio, torch.full_like(ratio, ratio_cap))
    per_token, clipped, dual_clipped = clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_c)
    if weights is not None:
        per_token = per_token * weights.detach()
    metrics = _diagnostics(logprobs, old_logprobs, response_mask, clipped)
    metrics["dual_clip_fraction"] = masked_mean(dual_clipped.to(logprobs.dtype), response_mask)
    return per_token, metrics


def _sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (1/n_i) Σ_t m·(ℓ − ℓ_old), ``[B]``."""
    return masked_mean(logprobs - old_logprobs, mask, dim=-1)


@register_policy_loss("gspo", agg_mode="seq-mean-token-mean")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    log_ratio_max: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """GSPO: clip a length-normalised *sequence* ratio instead of per-token ratios.

        log s_i = (1/n_i) Σ_t m·(ℓ − ℓ_old)
        L_i = max(−A_i·s_i, −A_i·clip(s_i, 1 − ε_l, 1 + ε_h)),  A_i = masked mean of A_t

    L_i is broadcast over the tokens of i and aggregated (``seq-mean-token-mean`` gives the
    paper's 1/G Σ_i 1/|y_i| Σ_t). The gradient flows through s_i. ``log_ratio_max`` caps log s
    at 10 before ``exp`` (verl). Paper clip range ε_l = 3e-4, ε_h = 4e-4.
    Source: Zheng et al., "Group Sequence Policy Optimization", 2025, eq. 5–7.
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_s = _sequence_log_ratio(logprobs, old_logprobs, response_mask)
    if log_ratio_max is not None:
        log_s = log_s.clamp(max=log_ratio_max)
    seq_adv = masked_mean(advantages, response_mask, dim=-1)
    per_seq, clipped, _ = clipped_surrogate(torch.exp(log_s), seq_adv, clip_low, clip_high, None)
    per_token = per_seq.unsqueeze(-1).expand_as(logprobs)
    clipped_tokens = clipped.unsqueeze(-1).expand_as(logprobs)
    return per_token, _diagnostics(logprobs, old_logprobs, response_mask, clipped_tokens)


@register_policy_loss("gspo_token", agg_mode="seq-mean-token-mean")
def gspo_token(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    log_ratio_max: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """GSPO-token: the sequence ratio's value with a per-token gradient, for per-token advantages.

        log s_{i,t} = sg(log s_i) + ℓ_t − sg(ℓ_t)
        L_{i,t} = max(−A_{i,t}·s_{i,t}, −A_{i,t}·clip(s_{i,t}, 1 − ε_l, 1 + ε_h))

    With advantages constant within each sequence, values and gradients equal :func:`gspo`.
    Source: Zheng et al., "Group Sequence Policy Optimization", 2025, eq. 13–14.
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_s = _sequence_log_ratio(logprobs, old_logprobs, response_mask)
    if log_ratio_max is not None:
        log_s = log_s.clamp(max=log_ratio_max)
    log_s_token = log_s.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    per_token, clipped, _ = clipped_surrogate(torch.exp(log_s_token), advantages, clip_low, clip_high, None)
    return per_token, _diagnostics(logprobs, old_logprobs, response_mask, clipped)


@register_policy_loss("cispo", agg_mode="token-mean")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ratio_min: float | None = None,
    ratio_max: float | None = 5.0,
    log_ratio_clamp: float | None = 20.0,
) -> tuple[Tensor, Metrics]:
    """CISPO: clip the importance weight, keep every token's gradient.

        w_t = sg(clip(ρ_t, r_min, r_max));   L_t = −w_t·A_t·ℓ_t

    Convention (docs/algorithms.md §10.6): bounds are absolute ratios. The default follows the
    paper (no lower bound) with TRL's recommended upper cap 5.0 (ScaleRL); verl's behaviour is
    ``ratio_min = 1 − ε_low, ratio_max = 1 + ε_high``. The loss value contains ℓ itself, so
    only its gradient −w·A·∇ℓ is meaningful. ``clip_fraction`` counts tokens whose weight was
    clipped. Source: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention", 2025, eq. 4.
    """
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp).detach()
    unbounded = ratio_min is None and ratio_max is None
    weight = ratio if unbounded else ratio.clamp(min=ratio_min, max=ratio_max)
    per_token = -weight * advantages * logprobs
    return per_token, _diagnostics(logprobs, old_logprobs, response_mask, weight != ratio)


@register_policy_loss("sapo", agg_mode="seq-mean-token-mean")
def sapo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float | None = 20.0,
) -> tuple[Tensor, Metrics]:
    """SAPO: a smooth gate on the ratio instead of a hard clip.

        τ_t = τ_pos if A_t > 0 else τ_neg;   f(ρ) = (4/τ)·sigmoid(τ·(ρ − 1));   L_t = −f(ρ_t)·A_t

    ∂f/∂ρ = 4·s·(1 − s) with s = sigmoid(τ(ρ − 1)): 1 on-policy, decaying smoothly away from
    ρ = 1 (faster for negative advantages). There is no hard clip, so ``clip_fraction``
    reports the share of tokens whose gate has more than halved their gradient
    (4·s·(1 − s) < 0.5); ``gate_mean`` is the mean gate. Source: Gao et al., "Soft Adaptive
    Policy Optimization", 2025, eq. 6–8.
    """
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp)
    tau = torch.where(advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * advantages
    slope = (4.0 * gate * (1.0 - gate)).detach()
    metrics = _diagnostics(logprobs, old_logprobs, response_mask, slope < 0.5)
    metrics["gate_mean"] = masked_mean(slope, response_mask)
    return per_token, metrics


@register_policy_loss("pg", agg_mode="token-mean")
def pg(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Plain policy gradient (REINFORCE, GPG): L_t = −A_t·ℓ_t, optionally × sg(w_t).

    No ratio and no clip, so it is only correct on-policy (one update per batch). Its value
    is meaningless; the gradient −A·∇ℓ is the estimator. ``old_logprobs`` only feeds the
    ``approx_kl`` diagnostic; ``clip_fraction`` is 0. Sources: Williams, 1992; GPG: Chu et
    al., 2025 (``token-mean``); a per-sequence log-likelihood is ``seq-mean-token-sum``.
    """
    per_token = -advantages * logprobs
    if weights is not None:
        per_token = per_token * weights.detach()
    return per_token, _diagnostics(
        logprobs, old_logprobs, response_mask, torch.zeros_like(response_mask, dtype=torch.bool)
    )
