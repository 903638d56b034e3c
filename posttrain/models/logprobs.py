"""Log-probabilities of the tokens a sequence actually contains.

Every loss in posttrain (SFT, the policy losses, KL to a reference) starts from these.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(tokens[b, t]) under softmax(logits[b, t]); shapes logits [B, T, V], tokens [B, T] → [B, T].

    `logits` must already be aligned with `tokens`: for a causal LM that is
    ``token_logprobs(out.logits[:, :-1], input_ids[:, 1:])``. The softmax runs in float32,
    because bf16 log-probs are too coarse for the ratios and KL terms built from them.
    This version materialises the full [B, T, V] log-softmax; fine for small vocabularies.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
