"""Score a batch with several reward functions at once and combine them with weights.

Functions run concurrently — ``async def`` ones on one event loop, plain ones in threads —
because real rewards wait on things (a sandboxed test run, a reward-model server), and a
serial loop over them is what users of other stacks complain about. Each component is kept
separately (GDPO normalises them one by one; every one is logged).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.rewards.registry import NamedReward, RewardOutput


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names it."""


@dataclass
class RewardResult:
    """Scores of B completions under K reward functions."""

    names: list[str]
    components: Tensor  # [B, K] float32, NaN where a function returned None
    weights: Tensor  # [K]
    metrics: dict[str, float]

    @property
    def scores(self) -> Tensor:
        """[B] Σ_k w_k·r_k over the components that are present; NaN when none is (the sample
        is then masked out of the update, never scored 0)."""
        present = ~torch.isnan(self.components)
        weighted = torch.where(present, self.components * self.weights, torch.zeros_like(self.components))
        return torch.where(present.any(-1), weighted.sum(-1), torch.full_like(weighted[:, 0], math.nan))


class RewardSet:
    """The configured reward functions with their weights."""

    def __init__(self, rewards: Sequence[NamedReward], max_threads: int = 8) -> None:
        if not rewards:
            raise ValueError("at least one reward function is needed")
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique (use 'label' to rename one): {names}")
        self.rewards = list(rewards)
        self.max_threads = max_threads

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Run every function on the batch; ``columns`` are aligned with ``completions``."""
        columns = dict(columns or {})
        for key, values in columns.items():
            if len(values) != len(completions):
                raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} completions")
        kwargs = {
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": [list(ids) for ids in completion_ids],
            **columns,
        }
        outcomes = _run_coroutine(self._run_all(kwargs))
        metrics: dict[str, float] = {}
        values = []
        for reward, (output, seconds) in zip(self.rewards, outcomes, strict=True):
            column = _check_output(reward.name, output, len(completions))
            values.append(column)
            metrics.update(_component_metrics(reward.name, column, seconds))
            if isinstance(output, RewardOutput):
                metrics.update({f"reward/{reward.name}/{k}": float(v) for k, v in output.metrics.items()})
        components = torch.tensor(values, dtype=torch.float32).T.reshape(len(completions), len(self.rewards))
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        return RewardResult(self.names, components, weights, metrics)

    async def _run_all(self, kwargs: dict[str, Any]) -> list[tuple[Any, float]]:
        with ThreadPoolExecutor(max_workers=min(self.max_threads, len(self.rewards))) as pool:
            loop = asyncio.get_running_loop()
            return await asyncio.gather(*(self._run_one(reward, kwargs, loop, pool) for reward in self.rewards))

    @staticmethod
    async def _run_one(reward: NamedReward, kwargs: dict[str, Any], loop: Any, pool: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        try:
            if reward.is_async:
                output = await reward.fn(**kwargs)
            else:
                output = await loop.run_in_executor(pool, lambda: reward.fn(**kwargs))
        except Exception as error:
            raise RewardFunctionError(
                f"reward function {reward.name!r} raised {type(error).__name__}: {error}"
            ) from error
        return output, time.perf_counter() - start


def _run_coroutine(coroutine: Any) -> Any:
    """asyncio.run, also from code that already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _check_output(name: str, output: Any, expected: int) -> list[float]:
    values = output.values if isinstance(output, RewardOutput) else output
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"reward function {name!r} must return a list of {expected} floats (or None), got {type(values).__name__}"
        )
    if len(values) != expected:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for {expected} completions")
    column = []
    for i, value in enumerate(values):
        if value is None:
            column.append(math.nan)
            continue
        try:
            column.append(float(value))
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value!r} for completion {i}; expected a float or None"
            ) from None
    return column


def _component_metrics(name: str, column: list[float], seconds: float) -> dict[str, float]:
    present = [v for v in column if not math.isnan(v)]
    mean = sum(present) / len(present) if present else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in present) / len(present)) if present else math.nan
    return {
        f"reward/{name}/mean": mean,
        f"reward/{name}/std": std,
        f"reward/{name}/none_fraction": 1 - len(present) / max(len(column), 1),
        f"time/reward/{name}_s": seconds,
    }
