"""Name → function registries for the pieces an algorithm is made of.

An RL algorithm in posttrain is a choice of one entry per registry (docs/design.md, "One idea"),
so the loop looks functions up by name and never branches on an algorithm's name. Two rules
keep that safe: a name can be registered once (a silent overwrite would change what a
preset means), and an unknown name fails with the list of valid ones.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from posttrain.algos.masked import aggregate_loss
from posttrain.errors import PosttrainError

F = TypeVar("F", bound=Callable[..., Any])


class UnknownNameError(PosttrainError, KeyError):
    """A registry lookup with a name that is not registered (a user's typo in a config, most
    often: the message lists the valid names)."""

    def __str__(self) -> str:  # KeyError would print the message inside quotes
        return str(self.args[0])


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from a run, declared where it is registered
    (``@register_advantage("grpo", groups=True)``). The loop and the config checks read these
    instead of naming estimators, so a new estimator is one registered function."""

    groups: bool = False
    """It compares the samples of one prompt (``group_ids``): samples_per_prompt must be ≥ 2,
    and DAPO's dynamic sampling (which drops groups without spread) applies to it."""
    values: bool = False
    """It reads a critic's values: the run needs algorithm.critic."""
    baselines: tuple[str, ...] = ()
    """The ``algorithm.baseline`` kinds it reads (as ``baseline_scores``)."""
    baseline_required: bool = False
    """It has no meaning without one of ``baselines`` (ReMax without its greedy decode)."""
    reward_weights: bool = False
    """It weighs the reward components itself: the loop hands it the reward functions'
    weights as ``component_weights`` (unless the options set them)."""


@dataclass(frozen=True)
class BaselineNeeds:
    """What an ``algorithm.baseline`` kind needs from a run (``@register_baseline``)."""

    plays_greedy: bool = False
    """The rollout source plays one greedy sample per group and scores it (ReMax's baseline:
    ``sources/greedy_baseline.py``, for completions and episodes alike); else the registered
    factory makes what the loop keeps (a running baseline), or nothing."""


class Registry(dict[str, Callable[..., Any]]):
    """A dict of named functions that refuses duplicates and explains unknown names.

    `standard_inputs` are the keyword tensors the loop passes to *every* entry (for
    advantage estimators: token_rewards, response_mask, group_ids, ...). An entry declares
    only the ones it uses; the registered wrapper drops the others, so the loop can pass the
    full set uniformly while a misspelt *option* still raises ``TypeError``.
    """

    def __init__(self, kind: str, standard_inputs: Iterable[str] = ()) -> None:
        super().__init__()
        self.kind = kind
        self.standard_inputs = frozenset(standard_inputs)
        self.needs: dict[str, Any] = {}
        """Per entry, what it declared it needs from a run (``EstimatorNeeds`` for estimators)."""

    def register(self, name: str, needs: Any = None) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self[name].__module__}."
                    f"{self[name].__qualname__}); pick another name"
                )
            dict.__setitem__(self, name, _drop_unused_inputs(fn, self.standard_inputs))
            self.needs[name] = needs
            return fn

        return decorator

    def declares(self, name: str, parameter: str) -> bool:
        """Whether entry `name` takes `parameter` (a standard input or an option): a policy loss
        that takes ``weights`` can apply truncated importance weights, one that takes
        ``proximal_logprobs`` gets the policy at the start of the step as π_prox and the
        engine's log-probs as π_behav (``train/rl_update.py``)."""
        return parameter in inspect.signature(self[name]).parameters

    def names_where(self, predicate: Callable[[Any], bool]) -> list[str]:
        """The registered names whose declared needs satisfy `predicate`, sorted."""
        return sorted(name for name in self if predicate(self.needs.get(name)))

    def __getitem__(self, name: str) -> Callable[..., Any]:
        try:
            return dict.__getitem__(self, name)
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def __setitem__(self, name: str, fn: Callable[..., Any]) -> None:
        self.register(name)(fn)

    def option_names(self, name: str) -> frozenset[str] | None:
        """The options entry `name` takes: its keyword parameters besides the standard inputs
        (None when it takes any, through ``**kwargs``). Configs check option keys against it
        before a run starts, instead of a ``TypeError`` at the first step."""
        params = inspect.signature(self[name]).parameters  # follows functools.wraps to the entry itself
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return None
        named = (p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        return frozenset(named) - self.standard_inputs

    def unknown_message(self, name: str) -> str:
        valid = ", ".join(sorted(self))
        close = difflib.get_close_matches(str(name), list(self), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}; valid names: {valid}.{hint}"


def _drop_unused_inputs(fn: F, standard_inputs: frozenset[str]) -> F:
    params = inspect.signature(fn).parameters
    if not standard_inputs or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn
    unused = standard_inputs - set(params)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for key in unused & kwargs.keys():
            del kwargs[key]
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


ADVANTAGE_ESTIMATORS = Registry(
    "advantage estimator",
    standard_inputs=(
        "token_rewards",
        "response_mask",
        "group_ids",
        "values",
        "baseline_scores",
        "reward_components",
    ),
)
"""Advantage estimators: ``fn(token_rewards, response_mask, ..., **options) -> (advantages, returns)``."""

POLICY_LOSSES = Registry(
    "policy loss",
    standard_inputs=("logprobs", "old_logprobs", "advantages", "response_mask", "proximal_logprobs"),
)
"""Per-token policy losses: ``fn(logprobs, old_logprobs, advantages, response_mask, **options) -> (loss, metrics)``."""

PREFERENCE_LOSSES = Registry("preference loss type")
"""DPO-family losses on the reference-corrected log-ratio margin (see ``preference.py``)."""


def register_advantage(
    name: str,
    *,
    groups: bool = False,
    values: bool = False,
    baselines: tuple[str, ...] = (),
    baseline_required: bool = False,
    reward_weights: bool = False,
) -> Callable[[F], F]:
    """Register an advantage estimator under `name`, with what it needs from a run
    (:class:`EstimatorNeeds`)."""
    needs = EstimatorNeeds(groups, values, baselines, baseline_required, reward_weights)
    return ADVANTAGE_ESTIMATORS.register(name, needs)


register_preference_loss = PREFERENCE_LOSSES.register

BASELINES = Registry("baseline")
"""``algorithm.baseline`` kinds: ``factory() -> the running baseline the loop keeps and updates
with each batch's scores (``value``, ``update``, ``state_dict``), or None``; the estimators that
read one say so (``EstimatorNeeds.baselines``)."""


def register_baseline(name: str, *, plays_greedy: bool = False) -> Callable[[F], F]:
    """Register a baseline kind under ``name`` (:class:`BaselineNeeds`)."""
    return BASELINES.register(name, BaselineNeeds(plays_greedy))


def register_policy_loss(name: str, agg_mode: str = "token-mean") -> Callable[[F], F]:
    """Register a per-token loss ``fn(...) -> (L [B, T], metrics)`` under ``name``.

    The registered callable returns ``(aggregate_loss(L, response_mask, agg_mode), metrics)``
    and accepts ``agg_mode`` (default: the one given here, the paper's) plus the
    ``num_tokens`` / ``num_seqs`` / ``norm_constant`` options, so aggregation is one switch
    for every loss instead of a copy inside each. The per-token function stays reachable as
    ``POLICY_LOSSES[name].per_token``.
    """

    def decorator(per_token_fn: F) -> F:
        POLICY_LOSSES.register(name)(_aggregated(per_token_fn, agg_mode))
        return per_token_fn

    return decorator


def _aggregated(per_token_fn: Callable[..., Any], default_mode: str) -> Callable[..., Any]:
    signature = inspect.signature(per_token_fn)
    unused = POLICY_LOSSES.standard_inputs - set(signature.parameters)

    @functools.wraps(per_token_fn)
    def loss_fn(
        *args: Any,
        agg_mode: str = default_mode,
        num_tokens: Any = None,
        num_seqs: Any = None,
        norm_constant: float | None = None,
        **kwargs: Any,
    ) -> Any:
        for key in unused & kwargs.keys():
            del kwargs[key]
        bound = signature.bind(*args, **kwargs)
        per_token, metrics = per_token_fn(*bound.args, **bound.kwargs)
        mask = bound.arguments["response_mask"]
        loss = aggregate_loss(
            per_token, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant
        )
        return loss, metrics

    loss_fn.per_token = per_token_fn  # type: ignore[attr-defined]
    loss_fn.default_agg_mode = default_mode  # type: ignore[attr-defined]
    return loss_fn
