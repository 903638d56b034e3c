"""The environment contract (docs/design.md, "Next"), how a config's ``env.name`` /
``env.options`` become an environment factory, and a guarded caller for ``reset``/``step``.

An environment is any class with ``reset(row)`` and ``step(completion)``, sync or ``async
def``; each episode gets its own instance. A config names a built-in (``"support_bot"``) or a
class importable from the working directory (``"mypkg.envs:GuessNumber"``), exactly as a
reward is named; ``env.options`` go to the constructor as keyword arguments and are checked
against its parameters before the first episode, so a typo fails at start-up.

An environment that raises, hangs past its timeout or returns something that is not an
observation ends its episode with :class:`EpisodeError`: the caller counts it and leaves the
episode out of the loss; it is never scored as reward 0 (a crash would otherwise teach the
policy whatever preceded it).

Covers / does not cover (timeouts): a sync ``reset``/``step`` runs in a daemon thread and is
abandoned (not killed) when it overruns: Python cannot stop a thread, so a hung environment
keeps its thread (and CPU, if it spins) until it returns; being a daemon it never blocks
interpreter exit. An ``async def`` method awaited by :meth:`GuardedEnvironment.areset` /
``astep`` is cancelled at the timeout; one that blocks its event loop (``time.sleep`` inside
``async def``) cannot be interrupted, so the loop runs in a thread of its own and the caller ends
the run when it stops turning (``event_loop.py``); the sync :meth:`reset`/:meth:`step` run
coroutines on their own loop in the daemon thread, which bounds even those.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from posttrain.algos.registry import Registry
from posttrain.envs.event_loop import EpisodeLoop
from posttrain.errors import PosttrainError
from posttrain.user_code import import_named

Observation = str | list[dict[str, Any]]
"""Prompt text, or chat messages ``[{"role": ..., "content": ...}]``."""

ENVIRONMENTS = Registry("environment")
"""Built-in environments: name → class (constructor keyword arguments are ``env.options``)."""
register_environment = ENVIRONMENTS.register


@runtime_checkable
class Environment(Protocol):
    """The public contract: one instance per episode. Either method may be ``async def``.

    ``reset(row)``: ``row`` holds every dataset column of the prompt; returns the first
    observation. ``step(completion)``: the policy's turn, decoded → (the next observation,
    appended as a user or tool turn, or None; this turn's reward or None; done)."""

    def reset(self, row: dict[str, Any]) -> Observation: ...

    def step(self, completion: str) -> tuple[Observation | None, float | None, bool]: ...


class EnvSpecError(PosttrainError, ValueError):
    """``env.name`` or ``env.options`` cannot be resolved; the message names the key."""


class EpisodeError(PosttrainError, RuntimeError):
    """An environment raised, hung or returned something malformed: the episode ends as a
    counted error, never as reward 0. ``turn`` is 0 for ``reset``, k for the k-th ``step``;
    ``kind`` is ``"raised"``, ``"timeout"`` or ``"invalid"``; ``cause`` the exception, if any."""

    def __init__(self, message: str, *, turn: int, kind: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.turn, self.kind, self.cause = turn, kind, cause


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returned, checked: an observation (or None), a finite reward (or None), done."""

    observation: Observation | None
    reward: float | None
    done: bool


# ------------------------------------------------------------------------------------ resolving


def resolve_environment(name: str, options: Mapping[str, Any] | None = None) -> Callable[[], Any]:
    """``env.name`` (built-in or ``pkg.module:Class``) and ``env.options`` → a factory that
    builds one fresh environment per episode. The options are bound to the constructor's
    signature here, so a misspelt or missing one fails now, naming ``env.options`` and the
    parameters the constructor takes."""
    options = dict(options or {})
    if not isinstance(name, str) or not name:
        raise EnvSpecError(f"env.name must be a built-in ({_builtins()}) or 'pkg.module:Class', got {name!r}")
    cls = _import_class(name) if ":" in name else _builtin(name)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as error:
        raise EnvSpecError(
            f"env.options {options} do not fit environment {name!r} ({error}); it takes: {_parameters(cls)}"
        ) from None
    except ValueError:  # no signature to inspect (a builtin type): let the constructor say
        pass
    check = getattr(cls, "check_options", None)  # what the class can check of its options without a model
    if callable(check):
        check(**options)

    def factory() -> Any:
        try:
            return cls(**options)
        except Exception as error:  # the user's constructor: its failure ends the run with one message
            raise EnvSpecError(
                f"environment {name!r} could not be built with env.options {options}: {type(error).__name__}: {error}"
            ) from error

    factory.env_name = name  # type: ignore[attr-defined]  # for messages of the guarded caller
    return factory


def _builtins() -> str:
    import posttrain.envs  # noqa: F401  (registers the built-ins)

    return ", ".join(sorted(ENVIRONMENTS))


def _builtin(name: str) -> Any:
    import posttrain.envs  # noqa: F401  (registers the built-ins)

    if name not in ENVIRONMENTS:
        raise EnvSpecError(
            f"env.name: {ENVIRONMENTS.unknown_message(name)} Or name your own class as 'pkg.module:Class'."
        )
    return ENVIRONMENTS[name]


def _import_class(path: str) -> Any:
    malformed = f"env.name {path!r} must look like 'package.module:Class' (or a built-in: {_builtins()})"
    cls = import_named(path, what="env.name", malformed=malformed, error=EnvSpecError)
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if not callable(cls) or missing:
        raise EnvSpecError(
            f"env.name {path!r} is not an environment: it needs reset(row) and step(completion) methods"
            + (f" (missing: {', '.join(missing)})" if missing else "")
        )
    return cls


def _parameters(cls: Any) -> str:
    try:
        params = [p for p in inspect.signature(cls).parameters.values() if p.kind not in (p.VAR_POSITIONAL,)]
    except ValueError:
        return "(unknown)"
    named = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params]
    return ", ".join(named) or "no options"


# ------------------------------------------------------------------------------------- calling


class GuardedEnvironment:
    """One episode's environment behind a timeout and checks: ``reset`` is turn 0, the k-th
    ``step`` turn k. Anything that goes wrong inside the environment becomes an
    :class:`EpisodeError` carrying the turn and the cause."""

    def __init__(self, env: Any, *, timeout_s: float | None = 30.0, name: str | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"environment timeout must be positive seconds or None, got {timeout_s}")
        self.env, self.timeout_s = env, timeout_s
        self.name = name or type(env).__name__
        self.turn = 0

    def reset(self, row: dict[str, Any]) -> Observation:
        self.turn = 0
        return _observation(self._call_sync(self.env.reset, row), self._where("reset"), self.turn)

    def step(self, completion: str) -> StepResult:
        self.turn += 1
        return _step_result(self._call_sync(self.env.step, completion), self._where("step"), self.turn)

    async def areset(self, row: dict[str, Any]) -> Observation:
        self.turn = 0
        return _observation(await self._call_async(self.env.reset, row), self._where("reset"), self.turn)

    async def astep(self, completion: str) -> StepResult:
        self.turn += 1
        return _step_result(await self._call_async(self.env.step, completion), self._where("step"), self.turn)

    def _where(self, method: str) -> str:
        return f"environment {self.name!r}: {method} of turn {self.turn}"

    def _call_sync(self, fn: Callable[..., Any], arg: Any) -> Any:
        """Run ``fn(arg)`` (awaiting it on a private loop if it is a coroutine) in a daemon thread."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                value = fn(arg)
                box["value"] = asyncio.run(value) if inspect.isawaitable(value) else value
            except BaseException as error:  # handed to the caller's thread below
                box["error"] = error

        thread = threading.Thread(target=target, name=f"env-{self.name}-turn{self.turn}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise self._timeout()
        if "error" in box:
            raise self._raised(box["error"])
        return box["value"]

    async def _call_async(self, fn: Callable[..., Any], arg: Any) -> Any:
        try:
            return await asyncio.wait_for(_run(fn, arg), self.timeout_s)
        except TimeoutError:  # wait_for's own: the environment's exceptions arrive wrapped
            raise self._timeout() from None
        except _Raised as raised:
            raise self._raised(raised.error) from raised.error

    def _timeout(self) -> EpisodeError:
        return EpisodeError(
            f"{self._where('reset' if self.turn == 0 else 'step')} did not return within {self.timeout_s:g} s",
            turn=self.turn,
            kind="timeout",
        )

    def _raised(self, error: BaseException) -> EpisodeError:
        where = self._where("reset" if self.turn == 0 else "step")
        episode_error = EpisodeError(
            f"{where} raised {type(error).__name__}: {error}", turn=self.turn, kind="raised", cause=error
        )
        episode_error.__cause__ = error
        return episode_error


def run_concurrently(
    calls: Sequence[Callable[[], Awaitable[Any]]],
    limit: int,
    *,
    loop: EpisodeLoop | None = None,
    stall_s: float | None = None,
    what: str = "an environment call",
) -> list[Any | EpisodeError]:
    """Await ``calls`` (each makes one guarded call, e.g. ``lambda: env.astep(text)``) on one
    event loop, at most ``limit`` at a time; returns each one's result, or its
    :class:`EpisodeError` in its place. Sync environments run in their own threads meanwhile,
    async ones interleave on the loop, so a batch of slow tools (a sandboxed program, a web
    call) takes about the time of the slowest rather than the sum. ``loop``: the source's
    :class:`EpisodeLoop` (a fresh one otherwise); an async call that blocks it for ``stall_s``
    seconds raises :class:`EventLoopStalled` naming ``what``."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")

    async def gather() -> list[Any | EpisodeError]:
        slots = asyncio.Semaphore(limit)

        async def one(call: Callable[[], Awaitable[Any]]) -> Any | EpisodeError:
            async with slots:
                try:
                    return await call()
                except EpisodeError as error:
                    return error

        return await asyncio.gather(*(one(call) for call in calls))

    if not calls:
        return []
    if loop is not None:
        return loop.run(gather(), stall_s=stall_s, what=what)
    own = EpisodeLoop()
    try:
        return own.run(gather(), stall_s=stall_s, what=what)
    finally:
        own.close()


class _Raised(Exception):
    """Carries an exception of the environment past ``wait_for`` (which could not otherwise
    tell an environment's own ``TimeoutError`` from its timeout)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


async def _run(fn: Callable[..., Any], arg: Any) -> Any:
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(arg)
        return await in_daemon_thread(fn, arg)
    except Exception as error:
        raise _Raised(error) from error


async def in_daemon_thread(fn: Callable[..., Any], arg: Any) -> Any:
    """``fn(arg)`` in a daemon thread (awaiting its result on a private loop if it is a
    coroutine). Not the loop's executor: its threads are joined at interpreter exit, so one
    hung environment would hang the trainer's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target() -> None:
        try:
            value = fn(arg)
            if inspect.isawaitable(value):
                value = asyncio.run(value)
            outcome: tuple[Any, BaseException | None] = (value, None)
        except BaseException as error:
            outcome = (None, error)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the call timed out)
            loop.call_soon_threadsafe(_settle, future, *outcome)

    threading.Thread(target=target, daemon=True).start()
    return await future


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled by the timeout meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _observation(value: Any, where: str, turn: int) -> Observation:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [dict(m) for m in value]
    raise EpisodeError(
        f"{where} returned {_short(value)}; an observation is a string or a non-empty list of "
        "{'role': ..., 'content': str} messages",
        turn=turn,
        kind="invalid",
    )


def _step_result(value: Any, where: str, turn: int) -> StepResult:
    if not isinstance(value, tuple) or len(value) != 3:
        raise EpisodeError(
            f"{where} returned {_short(value)}; step must return (observation, reward, done)", turn=turn, kind="invalid"
        )
    observation, reward, done = value
    if observation is not None:
        observation = _observation(observation, where, turn)
    if reward is not None:  # NumPy's numbers are Real too (an environment scoring with NumPy)
        is_number = isinstance(reward, numbers.Real) and not isinstance(reward, bool)
        if not is_number or not math.isfinite(reward):
            raise EpisodeError(
                f"{where} returned reward {reward!r}; a reward is a finite number or None", turn=turn, kind="invalid"
            )
        reward = float(reward)
    if not isinstance(done, bool):
        raise EpisodeError(f"{where} returned done={done!r}; done must be True or False", turn=turn, kind="invalid")
    if observation is None and not done:
        raise EpisodeError(
            f"{where} returned no observation but done=False; nothing to continue from", turn=turn, kind="invalid"
        )
    return StepResult(observation, reward, done)


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
