"""The seam of the data-side features: a wrapper over a sampling source (single-turn
completions or environment episodes) that is itself one.

A *sampling source* (``SingleTurnSource``, ``EnvironmentSource``) offers, besides the
:class:`~posttrain.sources.RolloutSource` protocol: ``sample(step, round_index, group_offset)``
(draw a step's rows and score their samples; dynamic sampling draws further rounds),
``greedy_scores(batch)`` (one greedy sample per group, scored: ReMax's baseline), ``rows`` and
``sampler`` (their order; a curriculum replaces it), ``pad_id``, ``length_limit`` (the most tokens
one sample may sample) and ``single_reward``. A feature is one module with a subclass of
:class:`SourceWrapper` overriding ``sample`` (it acts on every draw: overlong shaping, the
curriculum, the reward metrics) or ``next_batch`` (it acts on the step's batch: dynamic
sampling, the greedy baseline); ``train/rl_sources.py`` composes them, the draw-level ones
innermost. A wrapper's own state joins the inner one's in :meth:`state_dict` (plain data: the
checkpoint's safetensors-and-JSON training state)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from posttrain.rollout.batch import RolloutBatch


class SourceWrapper:
    """Forwards the whole sampling-source interface to ``inner`` (see the module docstring)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    # ------------------------------------------------------------------ the RolloutSource protocol
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.sample(step)  # through this wrapper's own draw (a draw-level one overrides sample)

    def sync_weights(self, version: int) -> None:
        self.inner.sync_weights(version)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        return self.inner.load_state_dict(state)

    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------ the sampling-source interface
    def sample(self, step: int, round_index: int = 0, group_offset: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        return self.inner.sample(step, round_index, group_offset)

    def greedy_scores(self, batch: RolloutBatch) -> Tensor:
        return self.inner.greedy_scores(batch)

    def evaluate(self, rows: Any) -> dict[str, float]:
        return self.inner.evaluate(rows)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.inner.rows

    @property
    def sampler(self) -> Any:
        return self.inner.sampler

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        self.inner.sampler = sampler

    @property
    def engine(self) -> Any:
        return self.inner.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.inner.engine = engine

    @property
    def pad_id(self) -> int:
        return self.inner.pad_id

    @property
    def length_limit(self) -> int:
        return self.inner.length_limit

    @property
    def single_reward(self) -> bool:
        return self.inner.single_reward

    @property
    def last_result(self) -> Any:
        return self.inner.last_result
