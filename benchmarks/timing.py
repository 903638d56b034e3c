"""Timing shared by the benchmark scripts (run as ``python benchmarks/NAME.py``, so this
folder is on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def take_turns(sides: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each side, the sides interleaved call by call so that a
    slow spell of the machine hits every side alike; ``warmup`` untimed calls each first."""
    for fn in sides.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}
