"""What a reward function returned, checked: one float (or None) per completion, or for an
episode one value per assistant turn, never ±inf; and the per-function metrics of a batch.
A function that returns anything else stops the run with one message naming it and the sample."""

from __future__ import annotations

import math
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.rewards.registry import RewardOutput


class RewardFunctionError(PosttrainError, RuntimeError):
    """A reward function raised or returned something unusable; the message names it."""


def check_output(
    name: str, output: Any, expected: int, offset: int = 0, per_turn: bool = False
) -> tuple[list[float], list[int], dict[int, list[float]]]:
    """A function's values as floats (NaN for None), the batch indices where it returned NaN and,
    with ``per_turn`` (episodes), the lists of per-turn values by batch index (their sum is the
    value); raises naming the function for anything else than floats/None, or for ±inf.
    ``offset``: the batch index of the chunk's first sample."""
    values = output.values if isinstance(output, RewardOutput) else output
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"reward function {name!r} must return a list of {expected} floats (or None), got {type(values).__name__}"
        )
    if len(values) != expected:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for {expected} completions")
    column, nans, turns = [], [], {}
    for i, value in enumerate(values, start=offset):
        if value is None:
            column.append(math.nan)
            continue
        if isinstance(value, (list, tuple)):
            if not per_turn:
                raise RewardFunctionError(
                    f"reward function {name!r} returned a list for completion {i}: one value per assistant turn is "
                    "for episodes (env:); a single completion takes one float or None"
                )
            if any(v is None for v in value):
                raise RewardFunctionError(
                    f"reward function {name!r} returned {value!r:.80} for episode {i}: a per-turn list holds a number "
                    "for every assistant turn; return None instead of the list to leave the episode unscored"
                )
            turns[i] = [finite(name, v, i) for v in value]
            column.append(sum(turns[i]))
            continue
        number = finite(name, value, i)
        if math.isnan(number):
            nans.append(i)
        column.append(number)
    return column, nans, turns


def finite(name: str, value: Any, i: int) -> float:
    """``value`` as a float (NaN allowed: no score), or the error naming the function and sample. Text
    is not a number even where ``float`` reads it ("1.5"): a function returning strings is a bug."""
    try:
        if isinstance(value, (str, bytes, bytearray)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise RewardFunctionError(
            f"reward function {name!r} returned {value!r} for completion {i}; expected a float or None"
        ) from None
    if math.isinf(number):
        raise RewardFunctionError(
            f"reward function {name!r} returned {number!r} for completion {i} of the batch; a reward must be a "
            "finite float (or None for no score): an infinite one gives its whole group NaN advantages. "
            "Clip the value in the function"
        )
    return number


def component_metrics(name: str, column: list[float], seconds: float) -> dict[str, float]:
    present = [v for v in column if not math.isnan(v)]
    mean = sum(present) / len(present) if present else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in present) / len(present)) if present else math.nan
    return {
        f"reward/{name}/mean": mean,
        f"reward/{name}/std": std,
        f"reward/{name}/none_fraction": 1 - len(present) / max(len(column), 1),
        f"time/reward/{name}_s": seconds,
    }
