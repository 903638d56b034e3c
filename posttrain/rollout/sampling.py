"""Turning next-token logits into a choice: temperature, top-k, top-p, min-p, greedy.

Pure functions over ``[B, V]`` tensors so each rule can be tested by hand. Filters set the
logits of excluded tokens to −inf; the most likely token always survives every filter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from posttrain.rollout.types import SamplingParams

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


# Tokens per block of the two-level inverse CDF below: ~√V blocks and cumsums of this length.
CDF_BLOCK = 1024


class SamplingWorkspace:
    """Buffers reused from one decoding step to the next.

    A step's sampling makes a few ``[B, V]`` tensors (12.6 MB each for 64 rows of a 49k
    vocabulary). Allocated afresh every step, each costs its page faults again: glibc serves
    blocks this large by ``mmap`` and returns them on free, and with the decoder's own
    allocations in between its heap rarely keeps them. Measured on SmolLM2-135M (64 rows, 2
    cores) sampling took 20 ms a step that way and 5 ms with its memory kept. A buffer here is
    sized for the first call and reused for anything that fits.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, like: Tensor) -> Tensor:
        """A tensor shaped and typed like ``like``, whose contents are garbage."""
        buffer = self._buffers.get(name)
        numel = like.numel()
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(like.shape)


def sample_from_weights(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of ``weights [B, V]`` (non-negative, not necessarily normalised) with
    probability weight / row total; returns ``[B]`` long.

    Inverse CDF with one uniform number per row: drawing B uniforms instead of B·V
    (Gumbel-max, ``multinomial``) is most of the cost of a step's sampling on a CPU. In two
    levels, so the whole row is never cumulated: block totals pick the block of
    :data:`CDF_BLOCK` tokens where u falls, a cumsum inside that block the token. Cumulative
    sums are in float64 so that a 150k-token vocabulary keeps its small probabilities. Tokens of weight 0
    are never drawn: each search returns the first entry whose cumulative sum exceeds u, and
    u stays below the total it is searched in (scaled by 1 − 2⁻⁵⁰; the last token loses ~1e-15
    of probability).
    """
    rows, vocab = weights.shape
    if vocab <= CDF_BLOCK:  # one block: the row's own cumsum
        cdf = weights.cumsum(-1, dtype=torch.float64)
        u = torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=weights.device)
        u = u.mul_(cdf[:, -1:] * (1 - 2**-50))
        return torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1).squeeze(-1)
    full = vocab // CDF_BLOCK * CDF_BLOCK
    # block totals summed in the weights' dtype (a float64 copy of all [B, V] would cost more
    # than the rest of the step's sampling), accumulated across blocks in float64
    block_totals = weights[:, :full].unflatten(1, (-1, CDF_BLOCK)).sum(-1)  # [B, nb]
    if full < vocab:
        block_totals = torch.cat([block_totals, weights[:, full:].sum(-1, keepdim=True)], 1)
    block_cdf = block_totals.cumsum(-1, dtype=torch.float64)
    u = torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=weights.device)
    u = u.mul_(block_cdf[:, -1:] * (1 - 2**-50))
    block = torch.searchsorted(block_cdf, u, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [B, 1]
    # u's place inside its block: minus everything before the block (the same float64 numbers)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    inside = u - before
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=weights.device)  # [B, CDF_BLOCK]
    window = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    window_cdf = window.cumsum(-1, dtype=torch.float64)
    # the block's own cumsum may round a hair below its total: stay inside it
    inside = torch.minimum(inside, window_cdf[:, -1:] * (1 - 2**-50))
    offset = torch.searchsorted(window_cdf, inside, right=True).clamp_(max=CDF_BLOCK - 1)
    return (block * CDF_BLOCK + offset).squeeze(-1)


def sample_categorical(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of ``logits [B, V]`` from softmax(logits); returns ``[B]`` long.
    Tokens with −inf logits are never drawn (see :func:`sample_from_weights`)."""
    return sample_from_weights(torch.softmax(logits, dim=-1), generator)


class Choice(NamedTuple):
    """One decoding step's draw: ``tokens [B]`` long, their behaviour ``logprobs [B]`` float32 and,
    when asked for, each row's ``mask [B, K]`` of kept token ids (−1 padded)."""

    tokens: Tensor
    logprobs: Tensor
    mask: Tensor | None = None


def truncate(scaled: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """``scaled [B, V]`` (logits / temperature) with every token outside the sampler's kept set at
    −inf: min-p, then top-k, then top-p over what is left (vLLM's order: its min-p is a logits
    processor applied before its top-k/top-p sampler, so top-p's mass is that of the survivors)."""
    return top_p_filter(top_k_filter(min_p_filter(scaled, min_p), top_k), top_p)


def kept_ids(filtered: Tensor) -> Tensor:
    """``[B, K]`` long: the ids of each row's finite logits of ``filtered [B, V]``, ascending,
    −1 after them; K is the largest kept set of the batch — a sampling mask (DeepSeek-V3.2's
    "keep sampling mask", §3.1), the form the trainer reads it in."""
    kept = torch.isfinite(filtered)
    width = max(int(kept.sum(-1).max()), 1) if kept.numel() else 1
    # a stable descending sort of the flags puts each row's kept ids first, in order
    order = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :width]
    return order.masked_fill(~kept.gather(-1, order), -1)


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
    workspace: SamplingWorkspace | None = None,
    with_mask: bool = False,
) -> Choice:
    """Pick one token per row of ``logits [B, V]``; return the tokens and their behaviour log-probs.

    The behaviour log-prob is that of the distribution that sampled: log_softmax(logits /
    temperature) over the tokens top-k/top-p/min-p keep, renormalised over them — vLLM's
    ``processed_logprobs``; with no filter the full tempered distribution, and temperature 1 when
    greedy. ``banned_token`` (the pad id) is never chosen; it is a guard (a sampled pad would read
    as padding), not a sampling rule, so it takes no part in the log-prob or the kept set. With
    ``with_mask`` (and a filter on) :attr:`Choice.mask` holds each row's kept ids
    (:func:`kept_ids`). With a ``workspace`` the ``[B, V]`` intermediates live in its buffers
    (``logits`` is not written).
    """
    workspace = workspace or SamplingWorkspace()
    scaled = logits.float()
    if not greedy and temperature != 1.0:
        scaled = torch.div(scaled, temperature, out=workspace.take("scaled", scaled))
    filtered = not greedy and (top_k > 0 or top_p < 1.0 or min_p > 0.0)
    if filtered:
        scaled = truncate(scaled, top_k, top_p, min_p)
    logprobs = torch.log_softmax(scaled, dim=-1, out=workspace.take("logprobs", scaled))
    if greedy or filtered:
        candidates = scaled
        if banned_token is not None:
            candidates = workspace.take("candidates", scaled).copy_(scaled)
            candidates[:, banned_token] = NEG_INF
        tokens = candidates.argmax(dim=-1) if greedy else sample_categorical(candidates, generator)
    else:  # no filter: the weights are the probabilities, the banned token's set to 0
        probs = torch.exp(logprobs, out=workspace.take("probs", scaled))
        if banned_token is not None:
            probs[:, banned_token] = 0.0
        tokens = sample_from_weights(probs, generator)
    mask = kept_ids(scaled) if with_mask and filtered else None
    return Choice(tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), mask)


def behaviour_logprobs(logits: Tensor, tokens: Tensor, sampling: SamplingParams) -> Tensor:
    """The behaviour log-prob :func:`choose_tokens` reports, of given ``tokens [...]`` under
    ``logits [..., V]`` and the rules of ``sampling`` (−inf for a token the filters drop): what
    any engine's report is checked against."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if not sampling.greedy:
        flat = truncate(flat / sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    picked = torch.log_softmax(flat, dim=-1).gather(-1, tokens.reshape(-1, 1).long())
    return picked.view(tokens.shape)


def choose_by(
    logits: Tensor,
    sampling: SamplingParams,
    banned_token: int | None,
    generator: torch.Generator | None,
    workspace: SamplingWorkspace | None = None,
) -> Choice:
    """:func:`choose_tokens` with the rules of ``sampling`` (temperature, filters, greedy; the
    kept sets when ``sampling.sampling_mask``)."""
    return choose_tokens(
        logits,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        greedy=sampling.greedy,
        banned_token=banned_token,
        generator=generator,
        workspace=workspace,
        with_mask=sampling.sampling_mask,
    )
