"""reasoning-gym (Apache-2.0) as a source of verifiable tasks: ``data.task: reasoning_gym:<name>``.

reasoning-gym generates about a hundred task families from a seed (``gsm_symbolic``: GSM8K-style
word problems; ``basic_arithmetic``, ``chain_sum``, ``countdown``, logic puzzles, ...), each
with its own answer scorer. Rows here are

* ``prompt`` — the question;
* ``answer`` — the reference answer (what the ``math`` reward would compare with);
* ``completion`` — for tasks that ship a worked solution (``metadata.answer_cot``), that
  solution as ``<think> … </think><answer> … </answer>``, for a cold-start SFT;
* ``reasoning_gym_entry`` — the entry as JSON, which the ``reasoning_gym`` reward hands to the
  task's own scorer.

Training and held-out rows come from two different seeds, and training rows whose question is
also a held-out question are dropped (then more are drawn), so evaluation never sees a
training problem. ``data.task_options`` reaches ``reasoning_gym.create_dataset`` (e.g.
``{difficulty: ...}``), whatever options the task defines.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.data.loading import DataError
from posttrain.errors import MissingExtraError

PREFIX = "reasoning_gym:"
INSTALL_HINT = "pip install 'posttrain[tasks]'  (or: pip install reasoning-gym)"


def require_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or an ImportError that says how to install it."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MissingExtraError(f"reasoning-gym tasks need the 'reasoning-gym' package: {INSTALL_HINT}")
    import reasoning_gym

    return reasoning_gym


def seeds(seed: int) -> tuple[int, int]:
    """(training seed, held-out seed) of run ``seed``: two generator seeds drawn from a hash of it.

    reasoning-gym seeds item i of a dataset with ``Random(seed + i)``, so datasets of nearby
    seeds are shifted copies of each other: with seeds ``2s+1`` and ``2s+2`` run seeds 0 and 1
    shared 298 of 300 held-out problems. Seeds spread over [0, 2**31) keep every run's and
    split's item seeds apart (and below 2**32, which numpy-seeded tasks need); a chance overlap
    of the training and held-out items is still removed by :func:`make_task`."""
    draw = random.Random(f"posttrain:reasoning_gym:{seed}")  # a str seed hashes the same in every process
    return draw.randrange(2**31), draw.randrange(2**31)


def entry_row(entry: Mapping[str, Any]) -> dict[str, Any]:
    """One reasoning-gym entry as a posttrain row (see the module docstring)."""
    answer = str(entry["answer"])
    row: dict[str, Any] = {"prompt": entry["question"], "answer": answer}
    solution = entry.get("metadata", {}).get("answer_cot")
    if solution:
        row["completion"] = f"<think> {solution.strip()} </think><answer> {answer} </answer>"
    row["reasoning_gym_entry"] = json.dumps(entry, default=str)
    return row


def generate(name: str, size: int, seed: int, options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``size`` rows of the reasoning-gym task ``name``, deterministic by ``seed``."""
    gym = require_reasoning_gym()
    if size == 0:
        return []
    known = sorted(gym.factory.DATASETS)
    if name not in known:
        import difflib

        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise DataError(f"reasoning-gym has no task {name!r}; {hint}all {len(known)}: {', '.join(known)}")
    try:
        dataset = gym.create_dataset(name, size=size, seed=seed, **dict(options))
    except (TypeError, ValueError, AssertionError) as error:
        raise DataError(f"reasoning_gym:{name}: bad data.task_options {dict(options)} ({error})") from None
    return [entry_row(entry) for entry in dataset]


def make_task(name: str, options: Mapping[str, Any] | None = None) -> Callable[[int, int, int], Any]:
    """The ``(n_train, n_test, seed) -> TaskData`` generator of ``reasoning_gym:<name>``."""
    from posttrain.data.tasks import TaskData

    def task(n_train: int, n_test: int, seed: int) -> TaskData:
        train_seed, held_out_seed = seeds(seed)
        held_out = generate(name, n_test, held_out_seed, options or {})
        questions = {row["prompt"] for row in held_out}
        train, extra = [], 0
        while len(train) < n_train:  # replace any training problem that is also a held-out one
            fresh = generate(name, n_train + extra, train_seed, options or {})
            train = [row for row in fresh if row["prompt"] not in questions][:n_train]
            extra = max(2 * extra, n_train - len(train) + 8)
            if extra > 10 * max(n_train, 1):
                raise DataError(f"reasoning_gym:{name} repeats its held-out problems too often to draw {n_train}")
        return TaskData(train, held_out, "reasoning_gym")

    return task
