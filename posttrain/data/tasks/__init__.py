"""Built-in tasks that generate their own data from a seed, by name (``data.task``).

A task is a function ``(n_train, n_test, seed) -> TaskData``: the same arguments give the
same rows, and no held-out row is in training. Add one with ``@TASKS.register("name")``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.algos.registry import Registry
from posttrain.data.loading import DataError
from posttrain.data.tasks import arithmetic, preference, reverse


@dataclass(frozen=True)
class TaskData:
    """A task's rows, in the formats of ``posttrain.data.formats``."""

    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    reward: str | None  # the built-in reward that scores this task (None for preference data)


TASKS = Registry("task")
"""name → ``fn(n_train, n_test, seed) -> TaskData``."""


@TASKS.register("reverse")
def _reverse(n_train: int, n_test: int, seed: int) -> TaskData:
    """Reverse a name (prompt/completion + ``name``); held-out starts with the lecture's names."""
    train, held_out = reverse.split_names(n_train, n_test, seed=seed)
    return TaskData(reverse.make_rows(train), reverse.make_rows(held_out), "reverse")


@TASKS.register("arithmetic")
def _arithmetic(n_train: int, n_test: int, seed: int) -> TaskData:
    """Word problems with + − × (prompt/completion + ``answer``), scored by the ``math`` reward."""
    train, held_out = arithmetic.split_problems(n_train, n_test, seed=seed)
    return TaskData(train, held_out, "math")


@TASKS.register("preference")
def _preference(n_train: int, n_test: int, seed: int) -> TaskData:
    """Preference pairs labelled by ``preference.true_preference_score`` (the reward
    ``preference_rule``, which also scores RL on these prompts)."""
    train, held_out = preference.split_pairs(n_train, n_test, seed=seed)
    return TaskData(train, held_out, "preference_rule")


@TASKS.register("preference_sft")
def _preference_sft(n_train: int, n_test: int, seed: int) -> TaskData:
    """Demonstrations for the SFT stage of RLHF: the preferred response of each pair of the
    ``preference`` task (same seed, same pairs) as prompt/completion rows."""
    train, held_out = preference.split_pairs(n_train, n_test, seed=seed)
    return TaskData(preference.demonstrations(train), preference.demonstrations(held_out), "preference_rule")


@TASKS.register("preference_noisy")
def _preference_noisy(n_train: int, n_test: int, seed: int) -> TaskData:
    """The same pairs with ``preference.LABEL_NOISE`` of the training labels flipped; held-out clean."""
    train, held_out = preference.split_pairs(n_train, n_test, seed=seed, label_noise=preference.LABEL_NOISE)
    return TaskData(train, held_out, None)


@TASKS.register("support_bot")
def _support_bot(n_train: int, n_test: int, seed: int) -> TaskData:
    """Hidden issues of the ``support_bot`` environment (``env.name: support_bot``), one per row
    (``issue``) with its user's impatience (``difficulty``); held-out rows are other draws."""
    from posttrain.data.tasks.support import support_rows

    return TaskData(support_rows(n_train, seed), support_rows(n_test, seed + 1_000_003), None)


def get_task(name: str, options: Mapping[str, Any] | None = None) -> Callable[[int, int, int], TaskData]:
    """The task generator called `name`; an unknown name lists the valid ones.

    ``reasoning_gym:<task>`` generates a reasoning-gym task (``data.tasks.reasoning_gym``), with
    ``options`` passed to it; the built-in tasks take no options.
    """
    from posttrain.data.tasks.reasoning_gym import PREFIX, make_task

    if name.startswith(PREFIX):
        return make_task(name.removeprefix(PREFIX), options)
    if options:
        raise DataError(f"data.task_options only apply to {PREFIX}<task> tasks, not to {name!r}")
    return TASKS[name]
