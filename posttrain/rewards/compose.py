"""Score a batch with several reward functions at once and combine them with weights.

Functions run concurrently, because real rewards wait on things (a sandboxed test run, a
reward model) and a serial loop over them is what users of other stacks complain about:

- plain functions run in a pool of worker processes (``pool.py``), a function's batch split
  into contiguous chunks across the workers (a callable object runs whole, see
  :meth:`RewardSet._chunks`; a function that compares samples with each other needs
  ``chunks: 1``); a chunk that passes its timeout or whose worker dies gets ``None`` for its
  samples, counted in ``reward/<name>/timeouts`` and ``reward/<name>/crashes``, and the run
  goes on;
- functions a worker cannot receive (lambdas, closures, functions of the main script or a
  notebook) run in a thread instead, with a warning that says why; so do all plain functions
  with ``workers=0``. A thread cannot be stopped: on timeout its samples get ``None`` and the
  thread is abandoned;
- ``async def`` functions are awaited on one event loop (a timeout cancels them);
- functions marked ``runs_in_process = True`` (reward models, ``model_reward.py``) run in the
  trainer's process, in a thread, on the whole batch: they batch by themselves.

Each component is kept separately (GDPO normalises them one by one; every one is logged).
A function that *raises* is a bug and stops the run with its name; only hangs and crashes
become ``None``. What a function returns is checked:

- ``None`` is "no score"; how the weighted sum treats it (left out for a prompt the reward
  does not apply to, else the sample is masked, never scored 0) is ``combine.py``'s rule;
- NaN is read as ``None`` (TRL reads both as NaN), but as it is more often a bug (0/0, a
  model's NaN) than an answer, each batch with one logs a warning naming the function and
  the first sample, and ``reward/<name>/nan`` counts them: return ``None`` to say "no score";
- ±inf stops the run naming the function, the sample and the value: an infinite reward has
  no finite advantage, and its group's NaN advantages would be dropped without a word;
- when more than ``max_failed_fraction`` of a batch's samples get no score from a function
  (timeouts, crashes, ``None``/NaN where it applies), the run stops naming it and the counts
  (``reward/<name>/failed_fraction`` logs the share every step).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posttrain.rewards.combine import (
    DEFAULT_MAX_FAILED_FRACTION,
    combine,
    failed_share_message,
    prompt_groups,
    reward_applies,
    unscored,
)
from posttrain.rewards.outputs import RewardFunctionError, check_output, component_metrics
from posttrain.rewards.pool import (
    Deferred,
    Task,
    TaskResult,
    WorkerPool,
    call_in_thread,
    default_workers,
    pickled_function,
    slice_kwargs,
    split_batch,
)
from posttrain.rewards.registry import NamedReward, RewardOutput, build_builtin, reward_completions

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""Seconds one call (one chunk) may take unless its entry says otherwise: long enough for any
honest reward batch, short enough that a hang costs minutes, not the run."""


MIN_CHUNK = 8
"""Rows a plain function's chunk has at least, unless its entry sets ``chunks``: below that,
sending a chunk to another worker costs more than scoring it."""


class RewardPoolWarning(UserWarning):
    """A reward function cannot run in a worker process and runs in a thread instead."""


@dataclass
class RewardResult:
    """Scores of B completions under K reward functions."""

    names: list[str]
    components: Tensor  # [B, K] float32, NaN where a function returned None (or NaN), timed out or crashed
    weights: Tensor  # [K]
    metrics: dict[str, float]
    failed: Tensor | None = None  # [B, K] bool: the call timed out or its worker crashed; None: none did
    applies: Tensor | None = None  # [B, K] bool: reward k applies to sample i's prompt (combine.py)
    turn_values: list[dict[int, list[float]]] = field(default_factory=list)
    """Per function, the episodes it scored turn by turn (``per_turn``): episode index → one value
    per assistant turn; their sum is the episode's component."""

    @property
    def scores(self) -> Tensor:
        """[B] Σ_k w_k·r_k over the rewards that apply to the sample's prompt; NaN (the sample
        is masked out of the update, never scored 0) when one of them has no score for it or
        none applies. The rule: ``combine.py``."""
        failed = torch.zeros_like(self.components, dtype=torch.bool) if self.failed is None else self.failed
        applies = ~self.components.isnan() if self.applies is None else self.applies
        return combine(self.components, self.weights, applies, failed)


class RewardSet:
    """The configured reward functions with their weights, and the workers that run them.

    ``workers``: worker processes for plain functions (default: one per core, at most 8;
    0 runs them in threads). ``timeout_s``: seconds one call may take unless the reward's own
    ``timeout`` says otherwise (None: wait forever). ``max_failed_fraction``: the share of a
    batch's samples a function may leave unscored before :meth:`score` stops the run, unless
    the reward's own entry says otherwise (1: never). Workers start on the first call and are
    kept; :meth:`close` (or ``with RewardSet(...) as rewards:``) stops them. ``pool``: what runs
    the workers' tasks, built with their number (default :class:`WorkerPool`, processes here;
    ``rewards/ray_pool.py`` places them on a Ray cluster).
    """

    def __init__(
        self,
        rewards: Sequence[NamedReward],
        *,
        workers: int | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_failed_fraction: float = DEFAULT_MAX_FAILED_FRACTION,
        pool: Callable[[int], Any] | None = None,
    ) -> None:
        if not rewards:
            raise ValueError("at least one reward function is needed")
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique (use 'alias' to rename one): {names}")
        if workers is not None and workers < 0:
            raise ValueError(f"workers must be >= 0 (0: run plain functions in threads), got {workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if not 0 <= max_failed_fraction <= 1:
            raise ValueError(f"max_failed_fraction must be a share in [0, 1], got {max_failed_fraction}")
        self.rewards = list(rewards)
        self.workers = default_workers() if workers is None else workers
        self.timeout_s = timeout_s
        self.max_failed_fraction = max_failed_fraction
        self._pickled: dict[str, bytes] = {}
        self.modes: dict[str, str] = {}
        """How each function runs: "pool", "thread", "async" or "in_process"."""
        for reward in self.rewards:
            self.modes[reward.name] = self._mode(reward)
        self._pool: WorkerPool | None = None
        self._pool_lock = threading.Lock()
        self._make_pool = pool or WorkerPool

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
        group_ids: Tensor | None = None,
        per_turn: bool = False,
    ) -> RewardResult:
        """Run every function on the batch; ``columns`` are aligned with ``completions``.
        ``group_ids [B]`` says which samples answer the same prompt (whether a reward applies
        to a prompt is decided over its samples, ``combine.py``); default: equal prompts.
        Raises :class:`RewardFunctionError` for a function that raises, returns ±inf or leaves
        more than its ``max_failed_fraction`` of the samples unscored. ``per_turn`` (episodes): a
        function may return, for an episode, a list of one value per assistant turn instead of one
        value; the list's sum is its component, the list is kept in ``turn_values``."""
        columns = dict(columns or {})
        for key, values in columns.items():
            if len(values) != len(completions):
                raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} completions")
        kwargs = {
            "prompts": list(prompts),
            # TRL's shapes: after a conversational prompt, a completion is one assistant message
            "completions": reward_completions(prompts, completions),
            "completion_ids": [list(ids) for ids in completion_ids],
            **columns,
        }
        size = len(completions)
        outcomes = _run_coroutine(self._run_all(kwargs, size, per_turn))
        metrics: dict[str, float] = {}
        values, failed = [], []
        for reward, outcome in zip(self.rewards, outcomes, strict=True):
            values.append(outcome.values)
            failed.append(outcome.failed or [False] * size)
            metrics.update(component_metrics(reward.name, outcome.values, outcome.seconds))
            metrics[f"reward/{reward.name}/timeouts"] = float(outcome.timeouts)
            metrics[f"reward/{reward.name}/crashes"] = float(outcome.crashes)
            metrics[f"reward/{reward.name}/nan"] = float(len(outcome.nans))
            metrics.update({f"reward/{reward.name}/{k}": float(v) for k, v in outcome.metrics.items()})
            if outcome.nans:
                log.warning(
                    "reward %r returned NaN for %d of %d samples (first: completion %d); they get no score, like "
                    "None (return None to say so without this warning; counted in reward/%s/nan)",
                    reward.name,
                    len(outcome.nans),
                    size,
                    outcome.nans[0],
                    reward.name,
                )
        shape = (size, len(self.rewards))
        components = torch.tensor(values, dtype=torch.float32).T.reshape(shape)
        failed_mask = torch.tensor(failed, dtype=torch.bool).T.reshape(shape)
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        applies = reward_applies(components, prompt_groups(prompts) if group_ids is None else group_ids)
        self._check_failures(outcomes, unscored(components, applies, failed_mask), metrics)
        turn_values = [outcome.turns for outcome in outcomes]
        return RewardResult(self.names, components, weights, metrics, failed_mask, applies, turn_values)

    def _check_failures(self, outcomes: list[_Outcome], missing: Tensor, metrics: dict[str, float]) -> None:
        """Log each function's share of unscored samples; stop at the first above its limit."""
        size = missing.shape[0]
        for k, (reward, outcome) in enumerate(zip(self.rewards, outcomes, strict=True)):
            failed = int(missing[:, k].sum())
            metrics[f"reward/{reward.name}/failed_fraction"] = failed / max(size, 1)
            limit = self.max_failed_fraction if reward.max_failed_fraction is None else reward.max_failed_fraction
            message = failed_share_message(
                reward.name,
                failed,
                size,
                limit,
                timeouts=outcome.timeouts,
                crashes=outcome.crashes,
                timeout_s=self._timeout(reward),
            )
            if message is not None:
                raise RewardFunctionError(message)

    def state_dict(self) -> dict[str, Any]:
        """The state of every stateful reward function (see ``NamedReward.stateful``), by name: tensors
        and JSON values only, as a checkpoint holds nothing else (``run/plain_state.py``)."""
        return {r.name: r.fn.state_dict() for r in self.rewards if r.stateful}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Restore what :meth:`state_dict` saved; returns the stateful rewards it held nothing for."""
        missing = []
        for reward in self.rewards:
            if not reward.stateful:
                continue
            if reward.name in state:
                reward.fn.load_state_dict(state[reward.name])
            else:
                missing.append(reward.name)
        return missing

    def start(self) -> None:
        """Start the worker processes now rather than on the first call (~2 s: each imports
        torch), so the first step's reward time is the rewards' own."""
        if "pool" in self.modes.values():
            self._ensure_pool().start()

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mode(self, reward: NamedReward) -> str:
        if reward.is_async:
            return "async"
        if reward.runs_in_process:
            return "in_process"
        if self.workers == 0:
            return "thread"
        data, why = pickled_function(reward.fn)
        if data is None and reward.builtin is not None:  # each worker builds its own from the options
            data, why = pickled_function(Deferred(build_builtin, *reward.builtin))
        if data is None:
            _warn_once(
                f"{reward.name}:{_qualified_name(reward.fn)}",
                f"reward function {reward.name!r} runs in a thread, not in a worker process: {why}. A thread "
                "cannot be stopped on timeout and shares the GIL; a function at the top level of a module "
                "(lambdas and nested functions cannot be pickled) runs in the worker pool",
            )
            return "thread"
        self._pickled[reward.name] = data
        return "pool"

    def _timeout(self, reward: NamedReward) -> float | None:
        seconds = self.timeout_s if reward.timeout_s is None else reward.timeout_s
        return None if seconds is None or math.isinf(seconds) else seconds

    async def _run_all(self, kwargs: dict[str, Any], size: int, per_turn: bool) -> list[_Outcome]:
        alone = [r for r in self.rewards if self.modes[r.name] != "pool"]
        pooled = [r for r in self.rewards if self.modes[r.name] == "pool"]
        jobs = [self._run_alone(r, kwargs, size, per_turn) for r in alone]
        if pooled:
            run = functools.partial(self._run_pooled, pooled, kwargs, size, per_turn)
            jobs.append(asyncio.wrap_future(call_in_thread(run, "reward-pool")))
        done = await asyncio.gather(*jobs)
        outcomes = {r.name: outcome for r, outcome in zip(alone, done, strict=False)}
        if pooled:
            outcomes.update(done[-1])
        return [outcomes[r.name] for r in self.rewards]

    async def _run_alone(self, reward: NamedReward, kwargs: dict[str, Any], size: int, per_turn: bool) -> _Outcome:
        mode, timeout = self.modes[reward.name], self._timeout(reward)
        start = time.perf_counter()
        try:
            if mode == "async":
                job = asyncio.ensure_future(reward.fn(**kwargs))
            else:
                call = functools.partial(reward.fn, **kwargs)
                job = asyncio.wrap_future(call_in_thread(call, f"reward-{reward.name}"))
        except Exception as error:  # an async function that raises before its first await
            raise _raised(reward.name, error, kwargs) from error
        # asyncio.wait, not wait_for: a TimeoutError the function raises itself is its error, not ours
        done, _ = await asyncio.wait({job}, timeout=timeout)
        if not done:
            job.cancel()  # stops a coroutine; a thread cannot be stopped and runs on, abandoned
            log.warning(
                "reward %r: no result after %g s; its %d samples get None%s",
                reward.name,
                timeout,
                size,
                "" if mode == "async" else " (its thread cannot be stopped and keeps running)",
            )
            return _Outcome([math.nan] * size, time.perf_counter() - start, timeouts=size, failed=[True] * size)
        if job.exception() is not None:
            raise _raised(reward.name, job.exception(), kwargs) from job.exception()
        output = job.result()
        column, nans, turns = check_output(reward.name, output, size, per_turn=per_turn)
        return _Outcome(column, time.perf_counter() - start, _metrics_of(output), nans=nans, turns=turns)

    def _run_pooled(
        self, rewards: list[NamedReward], kwargs: dict[str, Any], size: int, per_turn: bool
    ) -> dict[str, _Outcome]:
        """Every pooled function's chunks in one run of the pool, so chunks of different
        functions share the workers."""
        tasks, parts = [], []
        for reward in rewards:
            key = self.rewards.index(reward)
            for part in split_batch(size, min(self._chunks(reward, size), self.workers)):
                tasks.append(Task(key, self._pickled[reward.name], slice_kwargs(kwargs, part), self._timeout(reward)))
                parts.append((reward.name, part))
        start = time.perf_counter()
        results = self._ensure_pool().run(tasks)
        outcomes = {}
        for reward in rewards:
            mine = [(part, result) for (name, part), result in zip(parts, results, strict=True) if name == reward.name]
            outcomes[reward.name] = _combine_chunks(reward.name, mine, start, per_turn, kwargs)
        return outcomes

    def _chunks(self, reward: NamedReward, size: int) -> int:
        """How many pieces a function's batch is split into: its ``chunks`` entry or
        ``pool_chunks`` attribute if set; else a callable object (a built-in with options, such
        as ``code``, which runs its programs in parallel by itself and reports shares over the
        whole batch) runs whole, and a plain function gets one chunk per worker but none
        smaller than :data:`MIN_CHUNK` rows."""
        if reward.chunks is not None:
            return reward.chunks
        declared = getattr(reward.fn, "pool_chunks", None)
        if declared is not None:
            return int(declared)
        return math.ceil(size / MIN_CHUNK) if inspect.isfunction(reward.fn) else 1

    def _ensure_pool(self) -> WorkerPool:
        with self._pool_lock:
            if self._pool is None:
                self._pool = self._make_pool(self.workers)
            return self._pool


@dataclass
class _Outcome:
    """One function's values on the batch (NaN for None), its run time and why values are missing."""

    values: list[float]
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    timeouts: int = 0
    crashes: int = 0
    failed: list[bool] = field(default_factory=list)  # per sample: timed out or crashed ([]: none)
    nans: list[int] = field(default_factory=list)  # batch indices where the function returned NaN
    turns: dict[int, list[float]] = field(default_factory=dict)  # batch index → per-turn values (episodes)


def _combine_chunks(
    name: str, chunks: list[tuple[slice, TaskResult]], start: float, per_turn: bool, kwargs: Mapping[str, Any]
) -> _Outcome:
    """The chunks' values in batch order; a chunk's extra metrics are averaged over the chunks,
    weighted by their sizes. A chunk that raised raises here, naming the function."""
    values: list[float] = []
    failed: list[bool] = []
    nans: list[int] = []
    turns: dict[int, list[float]] = {}
    timeouts = crashes = 0
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part, result in chunks:
        n = part.stop - part.start
        failed += [result.status in ("timeout", "crash")] * n
        if result.status == "ok":
            column, chunk_nans, chunk_turns = check_output(name, result.value, n, offset=part.start, per_turn=per_turn)
            values += column
            nans += chunk_nans
            turns |= chunk_turns
            for key, value in _metrics_of(result.value).items():
                sums[key] = sums.get(key, 0.0) + float(value) * n
                counts[key] = counts.get(key, 0) + n
            continue
        if result.status == "error":
            shown = inputs_shown(slice_kwargs(kwargs, part))
            raise RewardFunctionError(f"reward function {name!r} {result.error}\n{shown}")
        log.warning("reward %r: %d samples get None: %s", name, n, result.error)
        values += [math.nan] * n
        timeouts += n if result.status == "timeout" else 0
        crashes += n if result.status == "crash" else 0
    seconds = max((r.finished for _, r in chunks), default=start) - start
    metrics = {key: total / counts[key] for key, total in sums.items()}
    return _Outcome(values, seconds, metrics, timeouts, crashes, failed, nans, turns)


def _raised(name: str, error: BaseException, kwargs: Mapping[str, Any]) -> RewardFunctionError:
    return RewardFunctionError(
        f"reward function {name!r} raised {type(error).__name__}: {error}\n{inputs_shown(kwargs)}"
    )


def inputs_shown(kwargs: Mapping[str, Any], examples: int = 2, width: int = 100) -> str:
    """What the function was given for its first ``examples`` samples: each keyword (the prompt,
    the completion, the row's columns) on a line of its own, cut to ``width`` characters."""
    size = len(kwargs.get("completions") or [])
    lines = []
    for index in range(min(examples, size)):
        lines.append(f"  its inputs for sample {index}:")
        for key, values in kwargs.items():
            if key == "completion_ids" or not isinstance(values, Sequence) or isinstance(values, str):
                continue
            shown = repr(values[index]) if index < len(values) else "(missing)"
            lines.append(f"    {key} = {shown if len(shown) <= width else shown[: width - 3] + '...'}")
    return "\n".join(lines)


def _metrics_of(output: Any) -> dict[str, float]:
    return dict(output.metrics) if isinstance(output, RewardOutput) else {}


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RewardPoolWarning, stacklevel=4)  # points at the RewardSet(...) call


def _qualified_name(fn: Any) -> str:
    owner = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(owner, '__module__', '?')}.{owner.__qualname__}"


def _run_coroutine(coroutine: Any) -> Any:
    """asyncio.run, also from code that already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
