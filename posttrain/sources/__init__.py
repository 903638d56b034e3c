"""Rollout sources: where the RL loop's batches come from.

The contract is docs/design.md, "Next: rollout sources, environments, async, scale-out". The
sources sit on the floor below the loop: they import nothing from ``train/`` (they take the
config sections they read and a :class:`~posttrain.sources.plan.SamplingPlan`; the wiring is
``train/rl_sources.py``).

The loop asks its source for one scored :class:`~posttrain.rollout.batch.RolloutBatch` per
step and never calls an engine or a reward itself; what happens before the batch exists —
sampling, scoring, DAPO's dynamic sampling and overlong shaping, ReMax's greedy baseline, a
curriculum — is the source's business. A new way of producing batches (a multi-turn
environment, a replay of recorded batches, an asynchronous producer, Ray workers) is one new
module here implementing :class:`RolloutSource`; a new data-side feature is one module wrapping
any sampling source (``wrapper.py``); the loop, the algorithms and the checkpoints stay as they are.

* ``single_turn.py`` — one completion per sample from the run's engine, scored by its rewards;
* ``environment.py`` — multi-turn episodes of an environment (``episodes.py``: one being played);
* ``dynamic_sampling.py``, ``overlong.py``, ``greedy_baseline.py``, ``curriculum.py``,
  ``reward_metrics.py`` — the data-side wrappers; ``difficulty_filter.py`` chooses the rows;
* ``held_out.py`` — held-out evaluation of single-turn runs;
* ``async_producer.py`` — another source run ahead of the learner (``rollout.max_staleness``);
* ``recorded.py`` — ``record_rollouts`` (a wrapper writing every batch it hands out) and
  ``rollout.replay`` (the recorded batches fed back: generation and update debugged apart).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from posttrain.rollout.batch import RolloutBatch


@runtime_checkable
class RolloutSource(Protocol):
    """What the RL loop needs from a producer of scored batches.

    ``next_batch(step)`` returns the batch of ``step`` (1-based) with ``scores`` and
    ``reward_components`` set (and ``baseline_scores`` where the algorithm compares with a
    baseline the source produces), plus the step's rollout metrics (``time/generate_s``,
    ``reward/*``, ``response/*``). ``sync_weights(version)`` is called after every update: the
    policy's weights changed and are now version ``version``. ``state_dict()`` holds everything
    a resumed run needs to draw exactly the batches a straight run draws (data order, reward
    normalisers); ``load_state_dict`` restores it and returns the names of parts it found no
    state for. ``start()``/``close()`` bracket the run (workers, engines)."""

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]: ...

    def sync_weights(self, version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> list[str]: ...

    def start(self) -> None: ...

    def close(self) -> None: ...
