"""AReaL's decoupled PPO objective for asynchronous, possibly stale rollouts (docs/algorithms.md §4.8)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from posttrain.algos.masked import masked_mean
from posttrain.algos.policy_losses import Metrics, _ratio, clipped_surrogate
from posttrain.algos.registry import register_policy_loss

BEHAVIOUR_WEIGHT_MODES = ("mask", "clamp", "none")


@register_policy_loss("decoupled_ppo", agg_mode="token-mean")
def decoupled_ppo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    proximal_logprobs: Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_c: float | None = None,
    behaviour_weight: Literal["mask", "clamp", "none"] = "mask",
    weight_cap: float | None = 5.0,
    weight_floor: float | None = None,
    weight_level: Literal["token", "sequence"] = "token",
    log_ratio_clamp: float | None = 20.0,
) -> tuple[Tensor, Metrics]:
    """Decoupled PPO: a trust region around π_prox, corrected for the stale behaviour policy.

        u_t = exp(ℓ − ℓ_prox)                    (trust region around π_prox)
        w_t = sg(exp(ℓ_prox − ℓ_behav))          (off-policy correction)
        L_t = w_t·max(−A_t·u_t, −A_t·clip(u_t, 1 − ε_low, 1 + ε_high))   (+ dual clip)
        loss = Σ_kept L_t / N_valid              (N_valid counts the ORIGINAL mask)

    ``old_logprobs`` are ℓ_behav (recorded by the inference engine when the tokens were sampled);
    ``proximal_logprobs`` are ℓ_prox (the policy at the start of this training step).
    ``behaviour_weight``: ``"mask"`` drops tokens whose w lies outside [weight_floor, weight_cap]
    from the numerator only (older AReaL default: cap 5); ``"clamp"`` clips w into that range;
    ``"none"`` applies no weight at all — what current AReaL does when no rejection-sampling block
    is configured (docs/algorithms.md §10, surprises). ``weight_level="sequence"`` uses one weight
    per sequence, the geometric mean of its token weights, so a stale sequence is kept or dropped
    whole. On-policy data (ℓ_prox = ℓ_behav) reduce this to PPO.
    Source: Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
    Language Reasoning", 2025, eq. 5.
    """
    if proximal_logprobs is None:
        raise ValueError("policy loss 'decoupled_ppo' needs proximal_logprobs (ℓ of π_prox)")
    if behaviour_weight not in BEHAVIOUR_WEIGHT_MODES:
        raise ValueError(f"unknown behaviour_weight {behaviour_weight!r}; valid: {', '.join(BEHAVIOUR_WEIGHT_MODES)}")
    clip_high = clip_low if clip_high is None else clip_high
    trust_ratio = _ratio(logprobs, proximal_logprobs, log_ratio_clamp)
    per_token, clipped, dual_clipped = clipped_surrogate(trust_ratio, advantages, clip_low, clip_high, clip_c)
    weight, kept = behaviour_weights(
        proximal_logprobs,
        old_logprobs,
        response_mask,
        behaviour_weight,
        weight_cap,
        weight_floor,
        weight_level,
        log_ratio_clamp,
    )
    # masked-out tokens contribute 0 to the sum but still count in the denominator
    per_token = torch.where(kept, per_token * weight, torch.zeros_like(per_token))
    with torch.no_grad():
        fractions = {"clip_fraction": clipped, "dual_clip_fraction": dual_clipped, "behaviour_masked_fraction": ~kept}
        metrics = {name: masked_mean(flags.to(logprobs.dtype), response_mask) for name, flags in fractions.items()}
        metrics["approx_kl"] = masked_mean(proximal_logprobs - logprobs.detach(), response_mask)
        metrics["behaviour_kl"] = masked_mean(old_logprobs - proximal_logprobs, response_mask)
        metrics["behaviour_weight_mean"] = masked_mean(weight, response_mask)
    return per_token, metrics


def behaviour_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    mode: str,
    cap: float | None,
    floor: float | None,
    level: str,
    log_ratio_clamp: float | None,
) -> tuple[Tensor, Tensor]:
    """(w, kept) of :func:`decoupled_ppo`: w_t = sg(exp(ℓ_prox − ℓ_behav)) per token, or per
    sequence as the geometric mean of its tokens' (``level="sequence"``); with ``mode="mask"``
    the tokens whose w lies outside [floor, cap] are not kept, ``"clamp"`` clips w into that
    range, ``"none"`` gives w = 1."""
    log_ratio = (proximal_logprobs - behaviour_logprobs).detach()
    if level == "sequence":
        # geometric mean of the token weights: one weight (and one keep/drop) per sequence
        log_ratio = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(proximal_logprobs)
    elif level != "token":
        raise ValueError(f"unknown weight_level {level!r}; valid: token, sequence")
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    weight = torch.exp(log_ratio)
    kept = torch.ones_like(response_mask, dtype=torch.bool)
    if mode == "none":
        weight = torch.ones_like(weight)
    elif mode == "clamp":
        weight = weight.clamp(min=0.0 if floor is None else floor, max=cap)
    else:
        if cap is not None:
            kept &= weight <= cap
        if floor is not None:
            kept &= weight >= floor
    return weight, kept


def loglinear_proximal_logprobs(
    behaviour_logprobs: Tensor, current_logprobs: Tensor, behaviour_versions: Tensor, proximal_version: int
) -> Tensor:
    """AReaL's approximation of ℓ_prox without a forward pass of the step-start policy:

        α_i = (v_prox − v_behav,i) / (v_θ − v_behav,i),   v_θ = v_prox + 1
        ℓ_prox ≈ ℓ_behav + α_i · (ℓ_θ − ℓ_behav)

    interpolating in log space between the behaviour policy (version ``behaviour_versions [B]``,
    or ``[B, T]`` per token, which sampled the tokens) and the policy being optimised, one version
    ahead of the proximal one. Fresh data (v_behav = v_prox) gives α = 0, ℓ_prox = ℓ_behav. ``current_logprobs`` should
    be detached. Source: AReaL docs, "Proximal Log-Probability Approximation" (prox_logp_method
    loglinear), 2025.
    """
    gap = (proximal_version - behaviour_versions).clamp(min=0).to(behaviour_logprobs.dtype)
    alpha = gap / (gap + 1.0)
    if alpha.dim() == 1:  # one version per sample, else per token (interrupted generation, §8.2)
        alpha = alpha.unsqueeze(-1)
    return behaviour_logprobs + alpha * (current_logprobs - behaviour_logprobs)
