"""Built-in reward names, and how a config's reward entry becomes a callable.

A reward function follows TRL's signature (docs/design.md, public contract)::

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

``columns`` holds every other dataset column of the rows being scored, aligned with
``completions``. As in TRL's GRPOTrainer, a row whose prompt is a conversation (a list of
``{"role", "content"}`` messages) gets its prompt as those messages and its completion as one
assistant message, ``[{"role": "assistant", "content": text}]`` (:func:`reward_completions`);
a text prompt gets text. So ``completion[0]["content"]`` written for TRL works unchanged.
``None`` means "not applicable / could not be computed": the sample is masked out, never
read as 0 (how several rewards combine around a ``None``: ``combine.py``). NaN is read as
``None`` but warned about and counted in ``reward/<name>/nan``; ±inf stops the run (a bug of
the function: it would make its group's advantages NaN). A function may instead return a
:class:`RewardOutput` to log extra metrics. ``async def`` functions are awaited.

A config names a reward as a built-in (``"math"``), a dotted path importable from the working
directory (``"mypkg.rewards:exact"``), or a mapping with options
(``{name: overlong, max_length: 64, cache_length: 16}``); built-ins that take options are
classes whose constructor receives them. Four keys of a mapping are about how the function
is run, not options of it, and work for every entry:

- ``alias``: the name it is logged under (to use one function twice, or shorten a path);
- ``timeout``: seconds one call (one chunk of the batch, see ``pool.py``) may take before
  its samples get ``None`` and a counted timeout; ``.inf`` for never; default: the
  RewardSet's;
- ``chunks``: at most this many pieces the batch is split into across worker processes;
  default: one per worker for a plain function (chunks of at least 8 rows), 1 (the whole
  batch) for a callable object such as ``code``. Use 1 for a function that compares samples
  with each other;
- ``max_failed_fraction``: stop the run when more than this share of a batch's samples get no
  score from it (timeouts, crashes, ``None``/NaN where it scores other samples of the same
  prompt); default: the RewardSet's (config ``reward_max_failed_fraction``, 0.5); 1: never.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.algos.registry import Registry
from posttrain.errors import PosttrainError
from posttrain.user_code import import_named

RewardFn = Callable[..., Any]

REWARDS = Registry("reward")
"""Built-in rewards: name → function, or → class taking options and returning a function."""
register_reward = REWARDS.register


class RewardSpecError(PosttrainError, ValueError):
    """A reward entry of a config that cannot be resolved (a path that does not import, an
    option the function does not take); the message names the entry."""


def reward_completions(prompts: Sequence[Any], completions: Sequence[Any]) -> list[Any]:
    """The completions as a reward function receives them: a decoded text after a
    conversational prompt becomes ``[{"role": "assistant", "content": text}]`` (TRL,
    ``GRPOTrainer._generate_and_score_completions``); after a text prompt it stays text.
    Completions already given as messages are kept. Decided per row, so a batch mixing
    both kinds of prompt gives each function what TRL would give it row by row."""
    return [
        [{"role": "assistant", "content": completion}]
        if isinstance(completion, str) and _is_chat(prompt)
        else completion
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


def call_reward(
    fn: RewardFn,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
) -> Any:
    """``fn``'s output for one batch, called as TRL calls a reward and as the RL loop does
    (``compose.py``): every argument by keyword, so ``def f(prompts, completions, answer, **columns)``
    and ``def f(completions, **kwargs)`` both work; an ``async def`` function is awaited."""
    output = fn(
        prompts=list(prompts),
        completions=reward_completions(prompts, completions),
        completion_ids=[list(ids) for ids in completion_ids],
        **columns,
    )
    if inspect.isawaitable(output):
        output = asyncio.run(output)
    return output


def _is_chat(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], Mapping)
    )


@dataclass
class RewardOutput:
    """What a reward function may return instead of a plain list: values plus metrics to log."""

    values: Sequence[float | None]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NamedReward:
    """A resolved reward: the callable, the name it is logged under, and its weight."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    timeout_s: float | None = None
    """Seconds one call may take; None: the RewardSet's default."""
    chunks: int | None = None
    """At most this many pieces a batch is split into across worker processes; None: the
    function's ``pool_chunks`` attribute if it has one, else see ``RewardSet._chunks``."""
    max_failed_fraction: float | None = None
    """Stop when more of a batch's samples than this share get no score; None: the RewardSet's."""
    builtin: tuple[str, dict[str, Any]] | None = None
    """(registered name, options) of a built-in class: a worker process builds its own copy
    from them when the object itself cannot be pickled (a lock, an open handle)."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise RewardSpecError(f"reward {self.name!r}: timeout must be positive seconds, got {self.timeout_s}")
        if self.chunks is not None and (isinstance(self.chunks, bool) or not isinstance(self.chunks, int)):
            raise RewardSpecError(f"reward {self.name!r}: chunks must be a positive integer, got {self.chunks!r}")
        if self.chunks is not None and self.chunks < 1:
            raise RewardSpecError(f"reward {self.name!r}: chunks must be a positive integer, got {self.chunks}")
        share = self.max_failed_fraction
        is_number = isinstance(share, (int, float)) and not isinstance(share, bool)
        if share is not None and (not is_number or not 0 <= share <= 1):
            raise RewardSpecError(f"reward {self.name!r}: max_failed_fraction must be a share in [0, 1], got {share!r}")

    @property
    def is_async(self) -> bool:
        # a class instance with an `async def __call__` is async too
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)

    @property
    def runs_in_process(self) -> bool:
        """True for functions that must stay in the trainer's process: a reward model holds
        its weights, maybe on the GPU, and batches by itself (it declares ``runs_in_process =
        True``); a function with state (``state_dict``/``load_state_dict``, e.g. a running
        normalisation) keeps one copy of it, here, where a checkpoint saves and restores it."""
        return bool(getattr(self.fn, "runs_in_process", False)) or self.stateful

    @property
    def stateful(self) -> bool:
        """The function carries state across calls that an exact resume must restore."""
        return callable(getattr(self.fn, "state_dict", None)) and callable(getattr(self.fn, "load_state_dict", None))


def resolve_reward(spec: str | Mapping[str, Any] | RewardFn, weight: float = 1.0) -> NamedReward:
    """A config entry (built-in name, ``pkg.module:fn`` path, mapping with options, or a
    callable) → :class:`NamedReward`. Errors name the entry and what to do."""
    if callable(spec) and not isinstance(spec, str):
        return NamedReward(getattr(spec, "__name__", type(spec).__name__), spec, weight)
    options: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        options = dict(spec)
        if "name" not in options:
            raise RewardSpecError(f"rewards entry {dict(spec)!r} needs a 'name' (a built-in or pkg.module:fn)")
        spec = options.pop("name")
    alias = options.pop("alias", None)
    run = {
        "timeout_s": _timeout(spec, options.pop("timeout", None)),
        "chunks": options.pop("chunks", None),
        "max_failed_fraction": options.pop("max_failed_fraction", None),
    }
    if ":" in spec:
        fn = _import_path(spec)
        if options:
            raise RewardSpecError(
                f"reward {spec!r} is a user function; options {sorted(options)} cannot be passed to it{_hint(options)}"
            )
        return NamedReward(alias or spec.split(":")[-1], fn, weight, **run)
    entry = REWARDS[spec]  # unknown names list the valid ones
    if inspect.isclass(entry):
        run["builtin"] = (spec, options)
        try:
            fn = entry(**options)
        except TypeError as error:
            raise RewardSpecError(f"reward {spec!r}: bad options {options}: {error}{_hint(options)}") from None
    elif options:
        raise RewardSpecError(f"built-in reward {spec!r} takes no options, got {sorted(options)}{_hint(options)}")
    else:
        fn = entry
    return NamedReward(alias or spec, fn, weight, **run)


def entry_name(spec: str | Mapping[str, Any] | RewardFn) -> str:
    """The name a config entry's reward is logged under (``reward/<name>/...``), without
    resolving it: its ``alias``, else a built-in's name or a path's function name."""
    if callable(spec) and not isinstance(spec, str):
        return getattr(spec, "__name__", type(spec).__name__)
    if isinstance(spec, Mapping):
        return str(spec.get("alias") or entry_name(str(spec.get("name", ""))))
    return spec.split(":")[-1] if ":" in spec else spec


def build_builtin(name: str, options: Mapping[str, Any]) -> RewardFn:
    """A built-in class's reward function, from its registered name and options (in a worker)."""
    import posttrain.rewards  # noqa: F401  (registers the built-ins in a fresh process)

    return REWARDS[name](**options)


def _hint(options: Mapping[str, Any]) -> str:
    # `label` renamed a reward before model rewards took it for a classifier's label
    return " (to rename a reward, use 'alias')" if "label" in options else ""


def _timeout(spec: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise RewardSpecError(f"reward {spec!r}: timeout must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise RewardSpecError(f"reward {spec!r}: timeout must be positive (.inf for none), got {value!r}")
    return seconds


def _import_path(path: str) -> RewardFn:
    malformed = f"reward path {path!r} must look like 'package.module:function'"
    fn = import_named(path, what="reward", malformed=malformed, error=RewardSpecError)
    if not callable(fn):
        raise RewardSpecError(f"reward {path!r} is not callable")
    return fn


def resolve_rewards(
    specs: Sequence[Any], weights: Sequence[float] | None = None, allow_constant: Sequence[str] = ()
) -> list[NamedReward]:
    """A run's reward functions from their specs (names, paths, option mappings, callables or
    ready :class:`NamedReward` s), one weight each (default 1); names listed in
    ``allow_constant`` must be among them."""
    from posttrain.config import ConfigError

    weights = list(weights) if weights else [1.0] * len(specs)
    if len(weights) != len(specs):
        raise ConfigError(f"reward_weights has {len(weights)} entries for {len(specs)} reward functions")
    rewards = [
        spec if isinstance(spec, NamedReward) else resolve_reward(spec, weight)
        for spec, weight in zip(specs, weights, strict=True)
    ]
    names = [reward.name for reward in rewards]
    unknown = [name for name in allow_constant if name not in names]
    if unknown:
        raise ConfigError(f"allow_constant_reward names {unknown}, which are not rewards of this run: {names}")
    return rewards
