"""The rollout engine and the trainer disagree: measuring it, and correcting the gradient for it.

An engine such as vLLM samples with its own kernels (and possibly another dtype), so the
log-probs it reports, ℓ_rollout, differ from the trainer's recomputation with the same weights,
ℓ_old. The samples then come from π_rollout, not from the π_old the loss assumes: the update is
slightly off-policy even with one update per batch.

Two pieces, both over ``[B, T]`` response tokens with a 0/1 mask:

* :func:`rollout_mismatch` — KL(π_rollout ‖ π_old) estimated from the sampled tokens (k3,
  ≥ 0, as ``kl_estimate``) and the largest |ℓ_old − ℓ_rollout|, logged every step.
* :func:`truncated_is_weights` — truncated importance sampling (TIS): each token's loss is
  multiplied by w_t = min(π_old/π_rollout, C), detached, which re-weights engine samples toward
  the trainer's policy with variance bounded by the cap C.
  Source: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  2025 (TIS, eq. 3, C = 2 in their runs); the same correction as IMPALA's truncated ρ̄
  (Espeholt et al. 2018, eq. 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algos.kl import kl_estimate
from posttrain.algos.masked import masked_mean


def truncated_is_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, cap: float) -> Tensor:
    """w_t = min(exp(ℓ_old,t − ℓ_rollout,t), C), detached, ``[B, T]``.

    The log-ratio is clamped to ±20 before ``exp`` (docs/algorithms.md §10.9) so one token whose
    engine log-prob is far off cannot overflow; the cap bounds the weight from above anyway.
    """
    if cap <= 0:
        raise ValueError(f"the truncated importance sampling cap must be > 0, got {cap}")
    log_ratio = (trainer_logprobs - engine_logprobs).detach().clamp(-20.0, 20.0)
    return torch.exp(log_ratio).clamp(max=cap)


@torch.no_grad()
def rollout_mismatch(
    trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, tis_cap: float | None = None
) -> dict[str, float]:
    """Metrics of the engine/trainer disagreement over the masked tokens.

    ``rollout/mismatch_kl``: mean_m k3 with d = ℓ_rollout − ℓ_old (samples are π_rollout's),
    an estimate of KL(π_rollout ‖ π_old) per token. ``rollout/logprob_diff_mean`` and
    ``rollout/logprob_diff_max``: mean and max of |ℓ_old − ℓ_rollout|. With ``tis_cap``, also
    ``rollout/tis_weight_mean`` and ``rollout/tis_capped_fraction`` (tokens whose weight hit C).
    """
    valid = mask.bool()
    diff = (trainer_logprobs - engine_logprobs).abs()
    kl = kl_estimate(engine_logprobs, trainer_logprobs, "k3", response_mask=mask)
    metrics = {
        "rollout/mismatch_kl": float(masked_mean(kl, mask)),
        "rollout/logprob_diff_mean": float(masked_mean(diff, mask)),
        "rollout/logprob_diff_max": float(diff[valid].max()) if bool(valid.any()) else 0.0,
    }
    if tis_cap is not None:
        weights = truncated_is_weights(trainer_logprobs, engine_logprobs, tis_cap)
        ratio = torch.exp((trainer_logprobs - engine_logprobs).clamp(-20.0, 20.0))
        metrics["rollout/tis_weight_mean"] = float(masked_mean(weights, mask))
        metrics["rollout/tis_capped_fraction"] = float(masked_mean((ratio > tis_cap).float(), mask))
    return metrics
