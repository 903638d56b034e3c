"""Group-relative (critic-free) advantage estimators (docs/algorithms.md §2.2–2.4, 2.6, 2.8, 2.9).

All of these read one scalar reward per response, ``r_i = Σ_t m·token_rewards[i, t]``,
compare it with the other samples of the same prompt (``group_ids``) and broadcast the
result to every valid token. Returns equal the advantages (there is no value target).
Shapes: ``token_rewards, response_mask [B, T]``; ``group_ids [B]``; outputs ``[B, T]``.

Estimators that need returns-to-go or a critic live in ``returns.py``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from posttrain.algos.groups import (
    SingletonMode,
    broadcast_to_tokens,
    check_singleton_mode,
    group_normalise,
    group_stats,
    sequence_scores,
)
from posttrain.algos.masked import masked_whiten
from posttrain.algos.registry import register_advantage

# Group-std epsilon (docs/algorithms.md §10.1). verl uses 1e-6, TRL 1e-4, OpenRLHF 1e-9. With
# near-identical rewards (σ ≈ 1e-7) eps = 1e-6 multiplies the advantage by ~10⁵; 1e-4 keeps
# it tame while changing ordinary advantages by < 0.01%. Option `eps` restores the others.
GROUP_STD_EPS = 1e-4


def _require(name: str, **tensors: Tensor | None) -> None:
    missing = [key for key, value in tensors.items() if value is None]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {', '.join(missing)}, which was not given")


@register_advantage("grpo", groups=True)
def grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    eps: float = GROUP_STD_EPS,
    norm_by_std: bool = True,
    std_scope: Literal["group", "batch"] = "group",
    singleton: SingletonMode = "raw",
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage: A_i = (r_i − μ_g) / (σ_g + ε), on every valid token of i.

    μ_g, σ_g are the mean and unbiased std of the rewards in i's group. ``norm_by_std=False``
    gives Dr. GRPO's advantage; ``std_scope="batch"`` divides by the std of all rewards in the
    batch instead (TRL ``scale_rewards="batch"``). Identical rewards in a group give exactly 0.
    Source: Shao et al., "DeepSeekMath", 2024, §4.1.2 (outcome supervision).
    """
    _require("grpo", group_ids=group_ids)
    scores = sequence_scores(token_rewards, response_mask)
    if std_scope == "group":
        adv = group_normalise(scores, group_ids, scale_by_std=norm_by_std, eps=eps, singleton=singleton)
    elif std_scope == "batch":
        adv = group_normalise(scores, group_ids, scale_by_std=False, eps=eps, singleton=singleton)
        if norm_by_std:
            spread = scores.std(unbiased=True) if scores.numel() > 1 else scores.new_ones(())
            adv = adv / (spread + eps)
    else:
        raise ValueError(f"unknown std_scope {std_scope!r}; valid: group, batch")
    adv = broadcast_to_tokens(adv, response_mask)
    return adv, adv


@register_advantage("dr_grpo", groups=True)
def dr_grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    singleton: SingletonMode = "raw",
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO advantage: A_i = r_i − μ_g (no division by σ_g).

    Removing σ_g removes GRPO's question-difficulty weighting; pair it with the
    ``seq-mean-token-sum-norm`` aggregation (constant C = max generation length) to also
    remove the per-response 1/|o_i| length bias.
    Source: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", 2025, §3.2.
    """
    _require("dr_grpo", group_ids=group_ids)
    scores = sequence_scores(token_rewards, response_mask)
    adv = group_normalise(scores, group_ids, scale_by_std=False, eps=0.0, singleton=singleton)
    adv = broadcast_to_tokens(adv, response_mask)
    return adv, adv


@register_advantage("rloo", groups=True)
def rloo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    singleton: SingletonMode = "raw",
) -> tuple[Tensor, Tensor]:
    """RLOO: A_i = r_i − (Σ_{j≠i} r_j)/(k − 1) = k/(k − 1)·(r_i − μ_g) within i's group.

    The leave-one-out baseline does not depend on sample i, so the estimate is unbiased.
    A group of one has no other sample: ``singleton="raw"`` keeps r_i, ``"zero"`` gives 0.
    Source: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", 2024, eq. 4 (baseline: Kool et al., 2019).
    """
    _require("rloo", group_ids=group_ids)
    check_singleton_mode(singleton)
    scores = sequence_scores(token_rewards, response_mask)
    stats = group_stats(scores, group_ids)
    k = stats.size
    leave_one_out = k / (k - 1).clamp(min=1) * stats.centred
    lone = scores if singleton == "raw" else torch.zeros_like(scores)
    adv = broadcast_to_tokens(torch.where(k == 1, lone, leave_one_out), response_mask)
    return adv, adv


@register_advantage("reinforce_pp_baseline", groups=True)
def reinforce_pp_baseline(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    unbiased: bool = True,
    singleton: SingletonMode = "raw",
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: a_i = r_i − μ_g, then A = whiten_m(broadcast(a)) over the batch.

    Convention (docs/algorithms.md §10.5): like verl, token rewards are summed to one scalar per
    response before the group mean is subtracted, so per-token KL shaping collapses into a
    sequence scalar. OpenRLHF instead keeps per-token KL in a reward-to-go; the two agree
    when the KL is in the loss, which is the recommended placement for this estimator.
    Whitening is token-weighted; ``unbiased=False`` is OpenRLHF's variance.
    Source: Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", 2025, §3.
    """
    _require("reinforce_pp_baseline", group_ids=group_ids)
    scores = sequence_scores(token_rewards, response_mask)
    centred = group_normalise(scores, group_ids, scale_by_std=False, eps=0.0, singleton=singleton)
    adv = masked_whiten(broadcast_to_tokens(centred, response_mask), response_mask, unbiased=unbiased)
    return adv, adv


GPG_ALPHA_MODES = ("nonzero_scores", "valid_samples")


@register_advantage("gpg", groups=True)
def gpg(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    alpha_mode: Literal["nonzero_scores", "valid_samples"] = "nonzero_scores",
    f_norm: float = 1.0,
    singleton: SingletonMode = "raw",
) -> tuple[Tensor, Tensor]:
    """GPG: A_i = α·(r_i − μ_g)/F_norm, with α compensating for groups that carry no signal.

    ``alpha_mode="nonzero_scores"`` (default, the verified verl form): α = B / max(#{r_i ≠ 0}, 1).
    ``alpha_mode="valid_samples"`` (the paper's description): α = B / max(B − M, 1), with M the
    number of samples in groups whose rewards are all equal.
    Source: Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", 2025, §3.
    """
    _require("gpg", group_ids=group_ids)
    scores = sequence_scores(token_rewards, response_mask)
    batch = scores.numel()
    if alpha_mode == "nonzero_scores":
        informative = (scores != 0).sum()
    elif alpha_mode == "valid_samples":
        informative = (group_stats(scores, group_ids).std > 0).sum()
    else:
        raise ValueError(f"unknown alpha_mode {alpha_mode!r}; valid: {', '.join(GPG_ALPHA_MODES)}")
    alpha = batch / informative.clamp(min=1).to(scores.dtype)
    centred = group_normalise(scores, group_ids, scale_by_std=False, eps=0.0, singleton=singleton)
    adv = broadcast_to_tokens(alpha * centred / f_norm, response_mask)
    return adv, adv


@register_advantage("gdpo", groups=True, reward_weights=True)
def gdpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    reward_components: Tensor | None = None,
    *,
    component_weights: Tensor | list[float] | None = None,
    eps: float = 1e-6,
    batch_norm: Literal["token", "sequence"] = "token",
    singleton: SingletonMode = "raw",
) -> tuple[Tensor, Tensor]:
    """GDPO: normalise each reward component in its group, sum with weights, renormalise.

        A^k_i = (r^k_i − μ_g(r^k)) / (σ_g(r^k) + ε)     S_i = Σ_k w_k·A^k_i     A = norm(S)

    Decoupling keeps reward combinations that plain GRPO on Σ_k w_k r^k maps to the same
    advantage apart. ``batch_norm="token"`` whitens S over valid tokens (verl, token-weighted,
    ε = 1e-8 in the root); ``"sequence"`` uses (S − mean)/(std + 1e-4) over the B responses
    (TRL ``normalize_then_sum``). ``reward_components`` is ``[B, K]``; ``token_rewards`` is
    not used (the components carry the rewards).

    A missing score (NaN) is never read as 0: a component NaN for every sample of a group
    (a reward that does not apply to that prompt) adds A^k = 0 there, as a component that
    cannot tell the group's samples apart does; a component NaN for only some samples of a
    group raises — such samples have no reward and must be masked out before (the loop does).
    Source: Liu et al., "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", 2026.
    """
    _require("gdpo", group_ids=group_ids, reward_components=reward_components)
    if reward_components.dim() != 2:
        raise ValueError(f"reward_components must be [B, K], got shape {tuple(reward_components.shape)}")
    num_components = reward_components.shape[1]
    weights = (
        torch.ones(num_components, dtype=reward_components.dtype, device=reward_components.device)
        if component_weights is None
        else torch.as_tensor(component_weights, dtype=reward_components.dtype, device=reward_components.device)
    )
    if weights.shape != (num_components,):
        raise ValueError(f"component_weights has {weights.numel()} entries for {num_components} components")
    absent = _absent_from_whole_groups(reward_components, group_ids)
    normalised = torch.stack(
        [
            group_normalise(
                reward_components[:, k].nan_to_num(0.0), group_ids, scale_by_std=True, eps=eps, singleton=singleton
            )
            for k in range(num_components)
        ],
        dim=1,
    )
    normalised = torch.where(absent, torch.zeros_like(normalised), normalised)
    summed = (normalised * weights).sum(1)
    if batch_norm == "token":
        adv = masked_whiten(broadcast_to_tokens(summed, response_mask), response_mask)
    elif batch_norm == "sequence":
        spread = summed.std(unbiased=True) if summed.numel() > 1 else summed.new_zeros(())
        adv = broadcast_to_tokens((summed - summed.mean()) / (spread + 1e-4), response_mask)
    else:
        raise ValueError(f"unknown batch_norm {batch_norm!r}; valid: token, sequence")
    return adv, adv


def _absent_from_whole_groups(components: Tensor, group_ids: Tensor) -> Tensor:
    """``[B, K]`` bool: component k is NaN for sample i and for every other sample of i's
    group. Raises for a component NaN for only part of a group (a sample with no reward)."""
    missing = components.isnan()
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    present = torch.zeros(groups, components.shape[1], dtype=components.dtype, device=components.device)
    present = present.index_add(0, index, (~missing).to(components.dtype))[index] > 0
    partial = missing & present
    if bool(partial.any()):
        sample, component = (int(v) for v in torch.nonzero(partial)[0])
        raise ValueError(
            f"gdpo: reward component {component} is missing (NaN) for sample {sample} but present for others of "
            f"its group; a sample without a reward must be masked out before the advantage, not scored 0"
        )
    return missing
