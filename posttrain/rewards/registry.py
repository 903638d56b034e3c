"""Built-in reward names, and how a config's reward entry becomes a callable.

A reward function follows TRL's signature (DESIGN.md, public contract)::

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

``columns`` holds every other dataset column of the rows being scored, aligned with
``completions``. ``None`` means "not applicable / could not be computed" and is masked out,
never read as 0. A function may instead return a :class:`RewardOutput` to log extra metrics.
``async def`` functions are awaited.

A config names a reward as a built-in (``"math"``), a dotted path importable from the working
directory (``"mypkg.rewards:exact"``), or a mapping with options
(``{name: overlong, max_length: 64, cache_length: 16}``); built-ins that take options are
classes whose constructor receives them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.algos.registry import Registry

RewardFn = Callable[..., Any]

REWARDS = Registry("reward")
"""Built-in rewards: name → function, or → class taking options and returning a function."""
register_reward = REWARDS.register


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

    @property
    def is_async(self) -> bool:
        # a class instance with an `async def __call__` is async too
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)


def resolve_reward(spec: str | Mapping[str, Any] | RewardFn, weight: float = 1.0) -> NamedReward:
    """A config entry (built-in name, ``pkg.module:fn`` path, mapping with options, or a
    callable) → :class:`NamedReward`. Errors name the entry and what to do."""
    if callable(spec) and not isinstance(spec, str):
        return NamedReward(getattr(spec, "__name__", type(spec).__name__), spec, weight)
    options: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        options = dict(spec)
        if "name" not in options:
            raise ValueError(f"reward entry {dict(spec)!r} needs a 'name' (a built-in or pkg.module:fn)")
        spec = options.pop("name")
    label = options.pop("label", None)
    if ":" in spec:
        fn = _import_path(spec)
        if options:
            raise ValueError(f"reward {spec!r} is a user function; options {sorted(options)} cannot be passed to it")
        return NamedReward(label or spec.split(":")[-1], fn, weight)
    entry = REWARDS[spec]  # unknown names list the valid ones
    if inspect.isclass(entry):
        try:
            fn = entry(**options)
        except TypeError as error:
            raise ValueError(f"reward {spec!r}: bad options {options}: {error}") from None
    elif options:
        raise ValueError(f"built-in reward {spec!r} takes no options, got {sorted(options)}")
    else:
        fn = entry
    return NamedReward(label or spec, fn, weight)


def _import_path(path: str) -> RewardFn:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward path {path!r} must look like 'package.module:function'")
    # the user's own modules live in the working directory, which `posttrain` (a console
    # script) does not put on sys.path by itself
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r} ({error})") from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable")
    return fn
