"""Turning next-token logits into a choice: temperature, top-k, top-p, min-p, greedy.

Pure functions over ``[B, V]`` tensors so each rule can be tested by hand. Filters set the
logits of excluded tokens to −inf; the most likely token always survives every filter.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row of ``[B, V]`` (ties at the k-th value are kept too);
    k ≤ 0 is off."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability reaches p, per row of ``[B, V]``."""
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
    """Min-p (Nguyen et al. 2024): drop tokens whose probability is below min_p × the most
    likely token's probability, per row of ``[B, V]``; 0 is off."""
    if min_p <= 0.0:
        return logits
    log_probs = torch.log_softmax(logits, dim=-1)
    threshold = log_probs.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=log_probs.dtype))
    return logits.masked_fill(log_probs < threshold, NEG_INF)


def sample_categorical(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of ``logits [B, V]`` from softmax(logits); returns ``[B]`` long.

    Inverts the cumulative distribution with one uniform number per row: drawing B uniforms
    instead of B·V (Gumbel-max, ``multinomial``) is most of the cost of a step's sampling on
    a CPU. The CDF is summed in float64 so that a 150k-token vocabulary keeps its small
    probabilities. Tokens with probability 0 (−inf logits) are never drawn: the search returns
    the first token whose CDF exceeds u, and u ≤ total·(1 − 2⁻⁵⁰) stays below the total even
    after rounding (the last token loses ~1e-15 of probability).
    """
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1, dtype=torch.float64)
    limit = cdf[:, -1:] * (1 - 2**-50)
    u = torch.rand(limit.shape, generator=generator, dtype=torch.float64, device=logits.device).mul_(limit)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


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
    """Pick one token per row of ``logits [B, V]``; return ``(tokens [B] long, logprobs [B] float32)``.

    The log-prob is that of the chosen token under log_softmax(logits / temperature), before
    truncation and before the ban — what a trainer recomputes from the same weights
    (temperature 1 when greedy). ``banned_token`` (the pad id) is never chosen.
    """
    scaled = logits.float()
    if not greedy and temperature != 1.0:
        scaled = scaled / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    candidates = scaled
    if banned_token is not None:
        candidates = scaled.clone()
        candidates[:, banned_token] = NEG_INF
    if greedy:
        tokens = candidates.argmax(dim=-1)
    else:
        candidates = min_p_filter(top_p_filter(top_k_filter(candidates, top_k), top_p), min_p)
        tokens = sample_categorical(candidates, generator)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
