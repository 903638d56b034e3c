"""Micro-batches bounded by samples and by tokens: how a minibatch is cut into forward/backward
passes. Pure functions of lengths; the loops (train/rl_update.py, rl_prepare.py, offline.py) turn
the bounds into passes.

A pass over left-padded prompts and right-padded responses costs (samples) × (longest prompt +
longest response) positions, padding included, so that is what ``max_tokens`` bounds; a
padding-free pass (``padding_free``, models/packing.py) costs the samples' own lengths. Samples
stay in their order (groups contiguous), so the same batch and bounds always give the same
passes: a run and its resume, and every rank, cut alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def micro_batch_bounds(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    max_samples: int | None = None,
    max_tokens: int | None = None,
    *,
    packed: bool = False,
) -> list[tuple[int, int]]:
    """``[start, end)`` ranges over the samples, in order: each pass holds at most
    ``max_samples`` samples and at most ``max_tokens`` positions — padded (rows × the longest),
    or with ``packed`` (padding-free passes) the samples' own — and at least one sample (a
    sample longer than the budget runs alone). No bound: one range."""
    count = len(prompt_lengths)
    bounds: list[tuple[int, int]] = []
    start, prompt, response, total = 0, 0, 0, 0
    for index in range(count):
        own = prompt_lengths[index] + response_lengths[index]
        wider_prompt = max(prompt, prompt_lengths[index])
        wider_response = max(response, response_lengths[index])
        rows = index - start + 1
        cost = total + own if packed else rows * (wider_prompt + wider_response)
        too_many = max_samples is not None and rows > max_samples
        too_long = max_tokens is not None and cost > max_tokens
        if rows > 1 and (too_many or too_long):
            bounds.append((start, index))
            start, wider_prompt, wider_response, total = index, prompt_lengths[index], response_lengths[index], 0
        prompt, response, total = wider_prompt, wider_response, total + own
    if count:
        bounds.append((start, count))
    return bounds


def offline_passes(rows: int, longest: int, accumulation: int, max_tokens: int | None) -> int:
    """How many equal passes an offline step takes: ``gradient_accumulation``, or more when its
    ``rows`` of up to ``longest`` tokens need more to stay within ``max_tokens`` each."""
    if max_tokens is None or rows == 0:
        return min(accumulation, max(rows, 1))
    per_pass = max(1, max_tokens // max(longest, 1))  # whole rows per pass
    return min(rows, max(accumulation, math.ceil(rows / per_pass)))


def example_cost(example: object) -> tuple[int, int]:
    """(rows, positions) a training example takes in a pass: a pair's chosen and rejected are
    two rows; an SFT example ``(ids, mask)`` one; a packed row (several examples) one row of
    their summed length."""
    chosen, rejected = getattr(example, "chosen", None), getattr(example, "rejected", None)
    if chosen is not None and rejected is not None:
        return 2, max(len(chosen[0]), len(rejected[0]))
    first = example[0]  # type: ignore[index]
    if isinstance(first, tuple):  # a packed row: a tuple of (ids, mask) examples
        return 1, sum(len(part[0]) for part in example)  # type: ignore[attr-defined]
    return 1, len(first)


def split_evenly(items: Sequence, parts: int) -> list[Sequence]:
    """``items`` in ``parts`` consecutive chunks whose sizes differ by at most one (none empty
    while ``parts`` ≤ ``len(items)``)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks
