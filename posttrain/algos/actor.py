"""Entropy from logits and the combined actor loss (docs/algorithms.md §4.10)."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algos.masked import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ_v softmax(z)_v·z_v over the last (vocabulary) dimension.

    ``[..., V] -> [...]``. Computed in float32 at least, since bf16 softmax loses the tail.
    Source: Schulman et al., "Proximal Policy Optimization Algorithms", 2017, eq. 9 (c₂·S).
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)


def actor_loss(
    policy_loss: Tensor,
    response_mask: Tensor,
    *,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    agg_mode: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = L_pg − c_ent·agg(H) + β·agg(kl), each term aggregated like the policy loss.

    ``policy_loss`` is the already-aggregated scalar from a ``POLICY_LOSSES`` entry;
    ``entropy`` and ``kl`` are per-token ``[B, T]`` (kl only when the KL sits in the loss).
    Source: Schulman et al., 2017, eq. 9; KL in the loss: Shao et al., "DeepSeekMath", 2024, eq. 3.
    """
    options = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_constant": norm_constant}
    total = policy_loss
    metrics: dict[str, Tensor] = {"policy": policy_loss.detach()}
    if entropy is not None:
        mean_entropy = aggregate_loss(entropy, response_mask, agg_mode, **options)
        metrics["entropy"] = mean_entropy.detach()
        if entropy_coef:
            total = total - entropy_coef * mean_entropy
    if kl is not None:
        mean_kl = aggregate_loss(kl, response_mask, agg_mode, **options)
        metrics["kl"] = mean_kl.detach()
        if kl_coef:
            total = total + kl_coef * mean_kl
    return total, metrics
