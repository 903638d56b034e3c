"""KL estimators, KL-in-reward shaping and KL coefficient controllers (docs/algorithms.md §3).

Tokens are sampled from π (the policy), so with d = ℓ − ℓ_ref the estimators below estimate
KL(π‖π_ref) from one sample per token. Where the KL goes is the caller's choice: subtract
β·kl from the token rewards (:func:`shape_token_rewards`; classic RLHF, RLOO, REINFORCE++)
or add β·agg(kl) to the loss (GRPO; see ``actor.actor_loss``). Use one placement, not both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.masked import masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")
# verl's names for the same estimators, accepted so configs ported from verl keep working
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+"}


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: str = "k3",
    *,
    response_mask: Tensor | None = None,
    clamp_log_ratio: float | None = 20.0,
    clamp_value: float | None = 10.0,
) -> Tensor:
    """Per-token KL(π‖π_ref) estimate from sampled tokens, ``[B, T]``.

    With d = ℓ − ℓ_ref:  k1 = d;  k2 = d²/2;  k3 = exp(−d) − 1 + d;  abs = |d|.
    ``k1+`` / ``k3+`` are straight-through: the value of k1 / k3 (for logging and the
    reward) with the gradient of k2, i.e. ``k2 − sg(k2) + sg(k)``.
    Gradient facts (samples held fixed): k1 as a loss has zero expected gradient (use it in
    the reward); k2's gradient d·∇ℓ is the reverse-KL gradient; k3's expected gradient is
    that of the *forward* KL(π_ref‖π).
    Clamps (docs/algorithms.md §10.9): −d is clamped to ±``clamp_log_ratio`` before ``exp`` and
    every value to ±``clamp_value`` (verl/OpenRLHF); pass None for TRL's unclamped k3.
    Masked positions are 0 when ``response_mask`` is given.
    Source: Schulman, "Approximating KL Divergence", 2020 (blog).
    """
    kind = KL_ALIASES.get(kind, kind)
    if kind not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)} (verl aliases: {', '.join(KL_ALIASES)})"
        )
    d = logprobs - ref_logprobs
    base = kind.rstrip("+")
    if base == "k1":
        value = d
    elif base == "k2":
        value = 0.5 * d * d
    elif base == "abs":
        value = d.abs()
    else:
        neg_d = -d if clamp_log_ratio is None else (-d).clamp(-clamp_log_ratio, clamp_log_ratio)
        value = torch.exp(neg_d) - 1.0 + d
    if clamp_value is not None:
        value = value.clamp(-clamp_value, clamp_value)
    if kind.endswith("+"):
        k2 = 0.5 * d * d
        value = k2 - k2.detach() + value.detach()
    if response_mask is not None:
        value = torch.where(response_mask.bool(), value, torch.zeros_like(value))
    return value


def place_scores_at_last_token(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome rewards ``[B]`` to token rewards ``[B, T]``: r_i on the last valid token of row i.

    A row with no valid token gets no reward (there is no action to credit).
    """
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(-1).values
    token_rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    token_rewards[rows, last[has_tokens]] = scores[has_tokens]
    return token_rewards


def shape_token_rewards(
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    beta: float,
    *,
    kind: str = "k1",
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL in the reward: token_reward[i, t] = 1[t = last]·r_i − β·kl_t·m[i, t].

    kl is computed from ℓ_old (the rollout-time policy) against ℓ_ref, usually k1, and is part
    of the return (discounted and whitened with everything else); no gradient flows through
    it. ``level="sequence"`` is TRL's RLOO form: r_i ← r_i − β·Σ_t kl_t, all on the last token.
    Returns ``(token_rewards [B, T], metrics)``; ``metrics["kl"]`` is the batch KL an adaptive
    controller consumes: mean_i(mean_{t valid} kl) (verl).
    Sources: Ziegler et al., "Fine-Tuning Language Models from Human Preferences", 2019;
    Ouyang et al., "Training language models to follow instructions", 2022, eq. 2.
    """
    with torch.no_grad():
        kl = kl_estimate(old_logprobs, ref_logprobs, kind, response_mask=response_mask)
        if level == "token":
            token_rewards = place_scores_at_last_token(scores, response_mask) - beta * kl
        elif level == "sequence":
            token_rewards = place_scores_at_last_token(scores - beta * kl.sum(-1), response_mask)
        else:
            raise ValueError(f"unknown KL level {level!r}; valid: token, sequence")
        has_tokens = response_mask.sum(-1) > 0
        per_seq = masked_mean(kl, response_mask, dim=-1)
        metrics = {
            "kl": per_seq[has_tokens].mean() if has_tokens.any() else kl.new_zeros(()),
            "kl_coef": torch.as_tensor(beta, dtype=kl.dtype),
        }
    return token_rewards, metrics


@dataclass
class FixedKLController:
    """β stays constant (verl default ``kl_ctrl.type=fixed``)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


@dataclass
class AdaptiveKLControllerPPO:
    """PPO paper rule: if d < d_targ/1.5 then β ← β/2; if d > 1.5·d_targ then β ← 2β.

    d is the measured KL after the update (to π_old in the paper's loss form, to π_ref in
    RLHF). The constants 1.5 and 2 are the paper's heuristics; the initial β hardly matters.
    Source: Schulman et al., "Proximal Policy Optimization Algorithms", 2017, §4.
    """

    value: float
    target: float
    tolerance: float = 1.5
    factor: float = 2.0

    def update(self, current_kl: float, n_steps: int = 0) -> float:
        if current_kl < self.target / self.tolerance:
            self.value /= self.factor
        elif current_kl > self.target * self.tolerance:
            self.value *= self.factor
        return self.value


@dataclass
class AdaptiveKLControllerHorizon:
    """Proportional rule of RLHF code: e = clip(KL/KL_target − 1, −0.2, 0.2); β ← β·(1 + e·n/H).

    ``n_steps`` is the number of samples in the batch just consumed (verl passes the batch
    size); H is the horizon. Defaults follow verl (β 0.001, target 0.1, horizon 10000).
    Source: Ziegler et al., "Fine-Tuning Language Models from Human Preferences", 2019, §2.2.
    """

    value: float = 0.001
    target: float = 0.1
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
