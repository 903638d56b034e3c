"""Timing shared by the benchmark scripts (run as ``python benchmarks/NAME.py``, so this
folder is on ``sys.path``)."""

from __future__ import annotations

import random
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


def model_and_tokenizer(path: str | None):
    """The model folder ``path`` (SmolLM2: ``runs/smollm2/base``), or the tiny model (2 × 128) built locally."""
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer

    if path:
        return load_causal_lm(path).eval(), load_tokenizer(path)
    tokenizer = build_char_tokenizer()
    return build_tiny_causal_lm(len(tokenizer), layers=2, hidden=128, heads=4, seed=0, tokenizer=tokenizer), tokenizer


def prompts_after_a_prefix(vocab: int, prefix: int, count: int, draw: random.Random) -> list[list[int]]:
    """``count`` prompts of random tokens: the same ``prefix`` tokens (a system message), then 10–40 of each's own."""
    vocabulary = range(4, min(vocab, 5000))
    system = [draw.choice(vocabulary) for _ in range(prefix)]
    return [system + [draw.choice(vocabulary) for _ in range(draw.randint(10, 40))] for _ in range(count)]
