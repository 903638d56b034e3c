"""Learning-rate schedules as multipliers of the base rate (for ``LambdaLR``)."""

from __future__ import annotations

import math
from collections.abc import Callable

SCHEDULES = ("constant_with_warmup", "cosine", "linear")


def lr_multiplier(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Step s (0-based) → factor. Linear warm-up over ``warmup_steps`` (step 0 trains at
    1/warmup of the rate, not 0, so no step is wasted), then:

    * ``constant_with_warmup``: 1 — the default for SFT before RL: a rate annealed to 0 where
      SFT stops leaves a flat policy whose samples RL cannot learn from;
    * ``cosine``: half a cosine from 1 down to ``min_ratio`` at ``total_steps``;
    * ``linear``: straight down to ``min_ratio``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * decay

    return factor
