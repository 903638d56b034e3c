"""The ``data:`` section every training command shares, and reading what it describes: a local
file (or Hub dataset) or a built-in task, with prompt and chat templates applied, each row still
naming the file line it came from for error messages."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from posttrain.algos.registry import UnknownNameError
from posttrain.config import Section
from posttrain.data import DataError, Rows, detect_format, read_dataset
from posttrain.data.tasks import get_task

T = TypeVar("T")


class DataSection(Section):
    path: str | None = None
    """Local data: .jsonl, .json, .parquet, .csv or a saved datasets folder. Overrides `task`."""
    task: str | None = None
    """A task that generates its data: built-in (reverse, arithmetic, preference, preference_sft,
    preference_noisy) or ``reasoning_gym:<name>`` (e.g. reasoning_gym:gsm_symbolic; needs the
    reasoning-gym package), whose rows are scored by the ``reasoning_gym`` reward."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """Options of a reasoning_gym task, passed to reasoning_gym.create_dataset (e.g. {difficulty: ...})."""
    prompt_column: str = "prompt"
    """Column holding the prompt, if not "prompt"."""
    prompt_template: str | None = None
    """Text around every prompt, with ``{prompt}`` where the prompt goes, applied on loading for
    SFT, RL and evaluation alike (a conversation: its last user message); or a named template:
    ``r1_zero`` (DeepSeek-R1-Zero's think/answer instruction, posttrain/data/prompt_templates.py)."""
    chat_template: bool = False
    """Send every text prompt through the tokenizer's chat template as one user message, the
    assistant's turn opened (instruct models, e.g. SmolLM2-Instruct); after ``prompt_template``.
    SFT completions then are the assistant's reply. Conversational rows always use it."""
    format: Literal["prompt", "prompt_completion", "preference", "conversational", "episode"] | None = None
    """Row format; detected from the columns when not given. "episode": rows of any columns, each
    starting an env episode (the default of a run with env)."""
    split: str | None = None
    """Split of a saved DatasetDict folder."""
    on_bad_row: Literal["error", "skip"] = "error"
    """Stop at the first invalid row, or skip invalid rows with a counted summary."""
    n_train: int = Field(4000, ge=1)
    """Training rows a task generates."""
    n_eval: int = Field(500, ge=0)
    """Held-out rows a task generates (evaluation)."""
    eval_path: str | None = None
    """Local held-out data in the format of `path`, evaluated before training, every
    `eval_every` steps and at the end (only those two with eval_every 0): sft logs eval/loss
    (token-mean NLL of the completions), dpo eval/loss, eval/accuracy, eval/margin,
    eval/chosen and eval/rejected (implicit rewards), rm eval/pairwise_accuracy, rl the
    rewards of greedy answers."""

    @field_validator("prompt_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None:
            from posttrain.data.prompt_templates import resolve_prompt_template

            resolve_prompt_template(value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if self.path is None and self.task is None:
            raise ValueError("set data.path (a local file or folder) or data.task (a built-in task)")
        # both read files only: with a task they would be silently ignored
        for key in ("eval_path", "split"):
            if getattr(self, key) is not None and self.path is None:
                raise ValueError(f"data.{key} applies to data.path, which is not set (data.task = {self.task!r})")
        return self


def load_rows(
    section: DataSection, seed: int, allowed_formats: tuple[str, ...] | None = None
) -> tuple[list[dict], list[dict], str | None]:
    """(train rows, held-out rows, name of the built-in reward that scores them, if any), with
    ``data.prompt_template`` and ``data.chat_template`` applied.

    ``allowed_formats`` makes a file of the wrong kind (e.g. prompt-only rows for SFT) fail at
    load time, naming the format found, rather than deep inside training."""
    train, held_out, reward = _read_rows(section, seed, allowed_formats)
    if section.prompt_template is not None:
        from posttrain.data.prompt_templates import template_rows

        template, column = section.prompt_template, section.prompt_column
        train = _same_places(train, template_rows(train, template, column))
        held_out = _same_places(held_out, template_rows(held_out, template, column))
    if section.chat_template:
        from posttrain.data.prompt_templates import chat_rows

        train = _same_places(train, chat_rows(train, section.prompt_column))
        held_out = _same_places(held_out, chat_rows(held_out, section.prompt_column))
    return train, held_out, reward


def _same_places(rows: list[dict], new: list[dict]) -> list[dict]:
    """`new` (copies of `rows`, transformed) still naming the file rows they came from."""
    return rows.replaced(new) if isinstance(rows, Rows) else new


def data_source(section: DataSection, held_out: bool = False) -> str:
    """How an error names where rows came from: the file, or the task that made them."""
    path = section.eval_path if held_out else section.path
    return path if path is not None else f"data.task={section.task}"


def encode_rows(encode: Callable[[dict], T], rows: Sequence[dict], source: str) -> list[T]:
    """``encode(row)`` of every row (an objective's ``encode``, RL's prompt encoding); a row the
    tokenizer's chat template cannot write as training needs it (``models/chat.py``) is a
    data error naming the file and row."""
    from posttrain.models.chat import ChatTemplateError

    where = rows.where if isinstance(rows, Rows) else (lambda index: f"row {index}")
    examples = []
    for index, row in enumerate(rows):
        try:
            examples.append(encode(row))
        except ChatTemplateError as error:
            raise DataError(f"{source}, {where(index)}: {error}") from None
    return examples


def _read_rows(
    section: DataSection, seed: int, allowed_formats: tuple[str, ...] | None
) -> tuple[list[dict], list[dict], str | None]:
    if section.path is not None:
        options = {
            "data_format": section.format,
            "prompt_column": section.prompt_column,
            "on_bad_row": section.on_bad_row,
            "split": section.split,
            "allowed_formats": allowed_formats,
        }
        held_out = read_dataset(section.eval_path, **options) if section.eval_path else []
        return read_dataset(section.path, **options), held_out, None
    curriculum = getattr(section, "curriculum", None)  # RL's data section alone has one
    try:
        if curriculum is not None and curriculum.column is None:  # levels of a task's options
            from posttrain.data.curriculum import curriculum_rows

            sizes = (section.n_train, section.n_eval, seed)
            return curriculum_rows(functools.partial(get_task, section.task), curriculum, section.task_options, *sizes)
        task = get_task(section.task, section.task_options)(section.n_train, section.n_eval, seed)
    except (DataError, UnknownNameError) as error:
        sizes = f"data.n_train = {section.n_train}, data.n_eval = {section.n_eval}"
        raise DataError(f"data.task = {section.task!r} ({sizes}): {error}") from None
    found = detect_format(list(task.train[0])) if task.train and section.format != "episode" else section.format
    if allowed_formats is not None and found not in allowed_formats:
        needed = " or ".join(map(repr, allowed_formats))
        raise DataError(f"data.task = {section.task!r} makes {found!r} rows, but this run needs {needed}")
    return task.train, task.held_out, task.reward


def check_enough_rows(rows: Sequence[dict], batch: int, key: str, section: DataSection) -> None:
    """One step's batch must fit in the data: checked once the rows are read, before a model loads."""
    if len(rows) < batch:
        raise DataError(
            f"{data_source(section)} has {len(rows)} usable rows, fewer than one step's batch ({key} = {batch}): "
            f"lower {key} or bring more rows"
        )
