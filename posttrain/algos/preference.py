"""Preference losses: the Bradley–Terry reward-model loss and the DPO family (docs/algorithms.md §5).

DPO variants act on summed completion log-probs (prompt tokens masked). With the
reference-corrected log-ratios ``Δ_w = π_w − π_ref,w`` and ``Δ_l = π_l − π_ref,l`` the
margin is ``h = Δ_w − Δ_l``; every variant is a function of h (IPO optionally of its
per-token average). Losses are means over pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.algos.registry import PREFERENCE_LOSSES, register_preference_loss


def bradley_terry_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    *,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward-model loss: mean(−log σ(r_w − r_l − m)) + c·mean((r_w + r_l)²).

    ``chosen``, ``rejected``: scalar rewards ``[N]`` of the preferred and the other response;
    ``margin`` [N]: optional preference strength (Llama 2); ``center_coef`` c keeps rewards
    centred at 0 (TRL ``center_rewards_coefficient``, suggested 0.01; off by default).
    Metrics: pairwise ``accuracy`` (r_w > r_l) and mean ``margin`` r_w − r_l.
    Sources: Bradley & Terry, "Rank Analysis of Incomplete Block Designs", 1952; Ouyang et
    al., "Training Language Models to Follow Instructions with Human Feedback", 2022, eq. 1;
    margin: Touvron et al., "Llama 2", 2023, eq. 2; centring: Eisenstein et al., "Helping or
    Herding?", 2023.
    """
    difference = chosen - rejected
    shifted = difference if margin is None else difference - margin
    loss = -F.logsigmoid(shifted).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        metrics = {"accuracy": (difference > 0).to(difference.dtype).mean(), "margin": difference.mean()}
    return loss, metrics


def _no_smoothing(loss_type: str, label_smoothing: float) -> None:
    # ipo and hinge have no label-noise term: a nonzero ε would be silently ignored
    if label_smoothing:
        raise ValueError(f"{loss_type} has no label_smoothing term (sigmoid and robust do), got {label_smoothing}")


@register_preference_loss("sigmoid")
def sigmoid(
    chosen_logratios: Tensor,
    rejected_logratios: Tensor,
    beta: float,
    *,
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """DPO: −log σ(β·h); with label smoothing ε it is conservative DPO,
    −(1 − ε)·log σ(βh) − ε·log σ(−βh).

    Convention (docs/algorithms.md §10.8): ε applies here as in OpenRLHF and the DPO authors'
    code (TRL ≥ 1.0 ignores it for "sigmoid"); ε = 0 is plain DPO. Returns per-pair ``[N]``.
    Sources: Rafailov et al., "Direct Preference Optimization", 2023, eq. 7; cDPO: Mitchell,
    "A Note on DPO with Noisy Preferences & Relationship to IPO", 2023.
    """
    logits = beta * (chosen_logratios - rejected_logratios)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


@register_preference_loss("ipo")
def ipo(
    chosen_logratios: Tensor,
    rejected_logratios: Tensor,
    beta: float,
    *,
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """IPO: loss = (h' − 1/(2β))², β playing the paper's τ.

    Convention (docs/algorithms.md §10.7): when lengths are given, h' uses per-token averaged
    log-ratios Δ_w/n_w − Δ_l/n_l (TRL, AReaL); without them the summed h (OpenRLHF).
    Source: Azar et al., "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", 2023, eq. 17.
    """
    _no_smoothing("ipo", label_smoothing)
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("ipo: pass both chosen_lengths and rejected_lengths, or neither")
    if chosen_lengths is not None:
        chosen_logratios = chosen_logratios / chosen_lengths.clamp(min=1)
        rejected_logratios = rejected_logratios / rejected_lengths.clamp(min=1)
    return (chosen_logratios - rejected_logratios - 1.0 / (2.0 * beta)) ** 2


@register_preference_loss("hinge")
def hinge(
    chosen_logratios: Tensor,
    rejected_logratios: Tensor,
    beta: float,
    *,
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """SLiC hinge: loss = max(0, 1 − β·h), a margin of 1/β on the reference-corrected log-ratio.

    Source: Zhao et al., "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", 2023, eq. 1.
    """
    _no_smoothing("hinge", label_smoothing)
    return torch.relu(1.0 - beta * (chosen_logratios - rejected_logratios))


@register_preference_loss("robust")
def robust(
    chosen_logratios: Tensor,
    rejected_logratios: Tensor,
    beta: float,
    *,
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """Robust DPO: [−(1 − ε)·log σ(βh) + ε·log σ(−βh)] / (1 − 2ε), unbiased under label flips
    at rate ε = ``label_smoothing`` (0 ≤ ε < 0.5, typically 0.1).

    Source: Chowdhury et al., "Provably Robust DPO: Aligning Language Models with Noisy
    Feedback", 2024, eq. 8.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    logits = beta * (chosen_logratios - rejected_logratios)
    noisy = -(1.0 - label_smoothing) * F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)
    return noisy / (1.0 - 2.0 * label_smoothing)


def chosen_nll(policy_chosen: Tensor, chosen_lengths: Tensor) -> Tensor:
    """RPO's likelihood term: mean over pairs of −π_w / n_w, the preferred response's negative
    log-likelihood per token (``policy_chosen`` summed log-probs ``[N]``, ``chosen_lengths`` its
    token counts).

    Added to a DPO loss with weight α it keeps the preferred answers likely: DPO alone can lower
    the chosen and rejected log-probs together while their margin grows, and the policy then
    drifts away from the data (Llama 3's DPO adds this term with α = 0.2).
    Convention (docs/algorithms.md §5.6): normalised per pair, as in the paper's eq. 3; TRL's
    ``rpo_alpha`` averages over all the micro-batch's chosen tokens instead.
    Source: Pang et al., "Iterative Reasoning Preference Optimization", 2024, eq. 3.
    """
    return (-policy_chosen / chosen_lengths.clamp(min=1)).mean()


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    *,
    label_smoothing: float = 0.0,
    nll_coef: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A DPO-family loss on summed completion log-probs ``[N]``, averaged over pairs, plus
    ``nll_coef`` α × :func:`chosen_nll` (RPO; α = 0 is off, the paper uses 1).

    ``loss_type`` names a ``PREFERENCE_LOSSES`` entry (sigmoid, ipo, hinge, robust, ...).
    Metrics use the implicit reward β·(log π − log π_ref): ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margin`` and ``rewards/accuracy`` (chosen above rejected);
    with ``chosen_lengths``, also ``nll`` (the chosen responses' NLL per token).
    """
    if nll_coef < 0:
        raise ValueError(f"nll_coef must be >= 0, got {nll_coef}")
    if nll_coef and chosen_lengths is None:
        raise ValueError("nll_coef needs chosen_lengths (the NLL term is per token)")
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    per_pair = PREFERENCE_LOSSES[loss_type](
        chosen_logratios,
        rejected_logratios,
        beta,
        label_smoothing=label_smoothing,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
    )
    with torch.no_grad():
        chosen_reward = beta * chosen_logratios.detach()
        rejected_reward = beta * rejected_logratios.detach()
        metrics = {
            "rewards/chosen": chosen_reward.mean(),
            "rewards/rejected": rejected_reward.mean(),
            "rewards/margin": (chosen_reward - rejected_reward).mean(),
            "rewards/accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype).mean(),
        }
    loss = per_pair.mean()
    if chosen_lengths is not None:
        nll = chosen_nll(policy_chosen, chosen_lengths)
        metrics["nll"] = nll.detach()
        if nll_coef:  # only then: plain DPO's loss stays exactly what it was
            loss = loss + nll_coef * nll
    return loss, metrics
