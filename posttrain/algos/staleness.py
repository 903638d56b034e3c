"""Bounded staleness for asynchronous RL (docs/algorithms.md §8.1)."""

from __future__ import annotations


def staleness_capacity(
    *,
    max_concurrent: int,
    running: int,
    accepted: int,
    version: int,
    max_staleness: int,
    batch_size: int,
) -> int:
    """How many new rollouts may start now without any sample exceeding the staleness bound η.

        capacity = min(max_concurrent − running, (η + i + 1)·B − (accepted + running))

    i = current policy version (trainer updates so far), B = training batch size in samples,
    ``accepted`` = samples finished and accepted so far. Equivalently, a new sample may start
    iff ⌊(N_started − 1)/B⌋ ≤ i + η, so no consumed sample is more than η versions old; η = 0
    is one-step-behind pipelining. After resuming at version v, set ``accepted = v·B`` so
    capacity does not burst. Never negative. Source: Fu et al., "AReaL: A Large-Scale
    Asynchronous Reinforcement Learning System for Language Reasoning", 2025, §5.1.
    """
    if batch_size <= 0 or max_staleness < 0:
        raise ValueError(f"need batch_size > 0 and max_staleness >= 0, got {batch_size} and {max_staleness}")
    by_concurrency = max_concurrent - running
    by_staleness = (max_staleness + version + 1) * batch_size - (accepted + running)
    return max(0, min(by_concurrency, by_staleness))
