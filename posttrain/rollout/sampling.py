"""Turning next-token logits into a choice: temperature, top-k, top-p, min-p, greedy.

Pure functions over ``[B, V]`` tensors so each rule can be tested by hand. Filters set the
logits of excluded tokens to −inf; at least the most likely token always survives.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row (ties at the k-th value are kept too); k ≤ 0 is off."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # a token is dropped when the tokens before it already reach p
    before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Drop tokens whose probability is below min_p × the most likely token's probability."""
    if min_p <= 0.0:
        return logits
    log_probs = torch.log_softmax(logits, dim=-1)
    threshold = log_probs.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=logits.dtype))
    return logits.masked_fill(log_probs < threshold, NEG_INF)


def gumbel_max_sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from softmax(logits): argmax(logits + Gumbel noise).

    The same distribution as ``multinomial(softmax(logits))`` (the Gumbel-max trick) in a
    handful of elementwise ops, which matters when sampling runs once per decoded token.
    """
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
    # clamp keeps log(0) away; the bias this adds is below float32 resolution
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=1e-20, max=1.0 - 1e-7)))
    return (logits + gumbel).argmax(dim=-1)


def choose_tokens(
    logits: Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    greedy: bool = False,
    banned_token: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick one token per row; return ``(tokens [B], logprobs [B])``.

    The log-prob is that of the chosen token under log_softmax(logits / temperature), before
    truncation and before the ban — what a trainer recomputes from the same weights
    (temperature 1 when greedy). ``banned_token`` (the pad id) is never chosen.
    """
    scaled = logits.float() if greedy else logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    candidates = scaled if banned_token is None else scaled.clone()
    if banned_token is not None:
        candidates[:, banned_token] = NEG_INF
    if greedy:
        tokens = candidates.argmax(dim=-1)
    else:
        candidates = min_p_filter(top_p_filter(top_k_filter(candidates, top_k), top_p), min_p)
        tokens = gumbel_max_sample(candidates, generator)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
