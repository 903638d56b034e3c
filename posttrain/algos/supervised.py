"""The supervised fine-tuning loss (docs/algorithms.md §6)."""

from __future__ import annotations

from torch import Tensor

from posttrain.algos.masked import aggregate_loss


def sft_loss(logprobs: Tensor, loss_mask: Tensor, agg_mode: str = "token-mean", **aggregation: float) -> Tensor:
    """Negative log-likelihood of the completion tokens only: agg(−ℓ_t) over ``loss_mask``.

    ``logprobs``, ``loss_mask`` ``[B, T]``; prompt tokens have mask 0 (label −100 in HF
    terms). ``token-mean`` is TRL's and OpenRLHF's default; ``seq-mean-token-mean`` is the
    per-sample mean. ``aggregation`` passes ``num_tokens`` etc. to ``aggregate_loss`` for
    gradient accumulation. Sources: Ouyang et al., "Training Language Models to Follow
    Instructions with Human Feedback", 2022 (SFT stage); Guo et al., "DeepSeek-R1", 2025
    (cold-start SFT).
    """
    return aggregate_loss(-logprobs, loss_mask, agg_mode, **aggregation)
