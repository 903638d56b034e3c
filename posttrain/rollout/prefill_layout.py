"""How a prefill lays out its rows when part of each is encoded already: the keys and values
of a prefix are then written into the cache's first columns, and only the rest is run through
the layers.

- a *shared prefix* (:func:`shared_prefix_length`, :func:`pads_after_prefix`): the tokens every
  prompt of a batch begins with (a system message, a tool list), encoded once for all rows;
- a *reused prefix* (:func:`reuse_layout`): each row's own first tokens, whose keys and values an
  earlier call computed (a multi-turn episode's next turn: ``rollout/turn_cache.py``).

Either way the columns keep positions (a position counts a row's real tokens), pads are masked
wherever they sit, and every row ends at the last column, where decoding continues.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lay_out(
    input_ids: Tensor, valid: Tensor, reused: Tensor | None, min_shared: int
) -> tuple[Tensor, Tensor, int, int]:
    """The columns of left-padded prompts ``input_ids [U, P]`` (``valid``: real tokens) for a
    prefill: ``[reused][pads][rest]`` when rows come with ``reused`` kept tokens each, else
    ``[shared prefix][pads][rest]`` when they begin with at least ``min_shared`` tokens alike,
    else as given. Returns the ids, the real-token mask, and how many first columns are reused
    or shared (one of the two is 0)."""
    if reused is not None:
        ids, valid, most = reuse_layout(input_ids, valid, reused)
        return ids, valid, most, 0
    shared = shared_prefix_length(input_ids, valid, min_shared) if input_ids.shape[0] > 1 else 0
    if shared:  # the prefix's columns the same in every row (pads are masked anywhere)
        input_ids, valid = pads_after_prefix(input_ids, valid, shared)
    return input_ids, valid, 0, shared


def shared_prefix_length(input_ids: Tensor, valid: Tensor, minimum: int) -> int:
    """How many first tokens all left-padded prompts ``input_ids [U, P]`` have alike (a system
    message, a few-shot prefix, an episode's first turns), leaving each at least one of its own;
    0 when fewer than ``minimum``."""
    lengths = valid.sum(-1)
    most = int(lengths.min()) - 1
    if most < minimum:
        return 0
    starts = input_ids.shape[1] - lengths
    aligned = input_ids.gather(1, starts[:, None] + torch.arange(most, device=input_ids.device))  # [U, most]
    alike = (aligned == aligned[:1]).all(0)
    shared = most if bool(alike.all()) else int((~alike).nonzero()[0])
    return shared if shared >= minimum else 0


def pads_after_prefix(input_ids: Tensor, valid: Tensor, shared: int) -> tuple[Tensor, Tensor]:
    """Left-padded prompts re-laid as ``[shared prefix][pads][the rest]``: the same width, each
    token keeping its position (positions count real tokens), the prefix in the same columns of
    every row so one encoding of it serves all."""
    width = input_ids.shape[1]
    pads = width - valid.sum(-1, keepdim=True)  # [U, 1]
    column = torch.arange(width, device=input_ids.device)[None]
    in_pads = (column >= shared) & (column < shared + pads)
    source = torch.where(column < shared, pads + column, column).clamp_(max=width - 1)
    return input_ids.gather(1, source).masked_fill_(in_pads, 0), ~in_pads


def reused_width(valid: Tensor, reused: Tensor) -> int:
    """How many columns :func:`reuse_layout` lays the prompts out in."""
    return int(reused.max()) + int((valid.long().sum(-1) - reused.to(valid.device)).max())


def reuse_layout(input_ids: Tensor, valid: Tensor, reused: Tensor) -> tuple[Tensor, Tensor, int]:
    """Left-padded prompts ``input_ids [U, P]`` re-laid as ``[reused][pads][the rest]``: row b's
    first ``reused[b]`` real tokens in columns ``[0, reused[b])``, its other tokens ending at the
    last column. Returns the ids, the real-token mask and R = max(reused), the first column that
    is not reused in any row. The width is R + the longest rest (it can exceed P)."""
    lengths = valid.long().sum(-1)
    starts = input_ids.shape[1] - lengths  # each row's first real column
    rest = lengths - reused
    most = int(reused.max())
    width = most + int(rest.max())
    column = torch.arange(width, device=input_ids.device)[None]
    in_reused = column < reused[:, None]
    rest_from = (width - rest)[:, None]
    in_rest = column >= rest_from
    source = torch.where(in_reused, starts[:, None] + column, starts[:, None] + reused[:, None] + column - rest_from)
    source = source.clamp_(0, input_ids.shape[1] - 1)
    real = in_reused | in_rest
    return input_ids.gather(1, source).masked_fill_(~real, 0), real, most
