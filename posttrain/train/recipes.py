"""Configs and entry points of ``posttrain sft | rm | dpo``: build the model and data a config
names, then hand them to the offline loop. Every option is documented once, here."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import Field, field_validator, model_validator

from posttrain.algos.registry import UnknownNameError
from posttrain.config import ConfigError, Section, dump_config
from posttrain.data import DataError, Rows, detect_format, read_dataset
from posttrain.data.tasks import get_task
from posttrain.train.offline import LoopConfig, held_out_metrics, train_offline

T = TypeVar("T")


class TinyModel(Section):
    """A tiny model built here with random weights (tests, demos, CPU benchmarks)."""

    arch: Literal["llama", "qwen2"] = "llama"
    """Model family of the config."""
    layers: int = Field(2, ge=1)
    """Decoder layers."""
    hidden: int = Field(128, ge=8)
    """Hidden size."""
    heads: int = Field(4, ge=1)
    """Attention heads."""
    intermediate: int | None = Field(None, ge=1)
    """MLP width (default 4 × hidden)."""
    tokenizer: Literal["char"] = "char"
    """The tokenizer built with it: one token per character."""
    max_positions: int = Field(2048, ge=16)
    """Context length (max_position_embeddings): prompt + completion tokens a row may have."""

    @model_validator(mode="after")
    def _head_shape(self) -> TinyModel:
        # each head takes hidden / heads channels, and rotary embeddings rotate them in pairs
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"model.tiny.hidden ({self.hidden}) must be divisible by model.tiny.heads ({self.heads}) "
                "into an even width per head (rotary embeddings rotate channel pairs)"
            )
        return self


class LoraSection(Section):
    r: int = Field(16, ge=1)
    """Adapter rank."""
    alpha: int = Field(32, ge=1)
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get adapters."""


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model folder, or a Hub id (org/name) found in the Hugging Face cache or
    downloaded into it. When set, `tiny` is ignored."""
    tiny: TinyModel | None = None
    """Build a tiny model from this spec instead of loading one."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype (a tiny model is built in float32, then cast)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (loaded and tiny models)."""
    lora: LoraSection | None = None
    """Train LoRA adapters instead of all weights (DPO then uses the adapter-free model as
    reference)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.path is None and self.tiny is None:
            raise ValueError("set model.path (a local model folder) or model.tiny (build a tiny model)")
        return self


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
    format: Literal["prompt", "prompt_completion", "preference", "conversational"] | None = None
    """Row format; detected from the columns when not given."""
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


class SFTRun(LoopConfig):
    model: ModelSection
    """The model to fine-tune."""
    data: DataSection
    """Prompt/completion or conversational rows."""
    eval_max_new_tokens: int = Field(16, ge=1)
    """Tokens generated per held-out prompt when evaluating a task's reward."""
    eval_batch_size: int = Field(256, ge=1)
    """Held-out prompts generated at once (lower it to bound the KV cache of a large model)."""
    eval_size: int | None = Field(None, ge=0)
    """Held-out rows evaluated before and after training (default: all of them; 0: no evaluation,
    e.g. when the RL run that follows evaluates the same model)."""
    packing: bool = False
    """Concatenate examples into sequences of up to `max_length` tokens, so a batch holds (almost)
    no padding. Packed examples do not see each other: positions restart at 0 for each example
    and attention is block-diagonal causal (a 4D mask; train/packing.py), and the loss stays the
    mean over completion tokens, so it does not depend on packing. The rows are packed once,
    before training: examples taken in a random order seeded by `seed`, each into the first row
    with room (greedy first-fit). `batch_size` then counts packed rows, reshuffled each epoch."""
    max_length: int | None = Field(None, ge=2)
    """Longest sequence trained on, in tokens (default: the model's context,
    max_position_embeddings); with `packing`, the length of a packed row. A row longer than it is
    refused, naming the row (or left out with data.on_bad_row=skip), never truncated."""


class RewardModelRun(LoopConfig):
    model: ModelSection
    """The body the scorer starts from (a policy folder, or a tiny model)."""
    data: DataSection
    """Preference rows (prompt, chosen, rejected, optional margin)."""
    center_coef: float = Field(0.0, ge=0)
    """Weight of mean((r_w + r_l)²), keeping rewards centred at 0."""


LABEL_SMOOTHING_LOSSES = ("sigmoid", "robust")  # the DPO losses with a label-noise term


class DPORun(LoopConfig):
    model: ModelSection
    """The policy; the reference is its frozen initial copy (or, with LoRA, itself without adapters)."""
    data: DataSection
    """Preference rows."""
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL to the reference."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """DPO-family loss."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Label noise ε, read by the sigmoid loss (conservative DPO) and robust DPO; ipo and hinge
    have no noise term, so a nonzero value with them is refused (as TRL defines it)."""

    @model_validator(mode="after")
    def _smoothing_is_used(self) -> DPORun:
        if self.label_smoothing and self.loss_type not in LABEL_SMOOTHING_LOSSES:
            raise ValueError(
                f"label_smoothing = {self.label_smoothing:g} is not used by loss_type = {self.loss_type!r}: "
                f"only {' and '.join(repr(n) for n in LABEL_SMOOTHING_LOSSES)} read it; set label_smoothing=0 "
                "or change loss_type"
            )
        return self


def micro_batch(config: LoopConfig) -> int:
    """Rows per forward pass in training, also used for held-out evaluation (same memory)."""
    return config.batch_size // config.gradient_accumulation


def check_run_dir(config: LoopConfig) -> None:
    """The run folder and resume point (``train/run_dir.py``) and the metric sinks, checked before
    any model loads."""
    from posttrain.telemetry.metrics import check_report_to
    from posttrain.train.run_dir import start_point

    start_point(config.output_dir, config.resume, config.overwrite, dump_config(config))
    check_report_to(config.report_to)


def check_model_source(section: ModelSection) -> None:
    """A model folder that cannot load is refused here, before data is read or anything is
    built: its config.json is read (no weights), and the message names ``model.path``."""
    if section.path is None:
        return
    from posttrain.models.loading import ModelLoadError, read_config

    try:
        read_config(section.path)
    except ModelLoadError as error:
        raise ModelLoadError(f"model.path: {error}") from None


def build_model_and_tokenizer(section: ModelSection, seed: int) -> tuple[Any, Any]:
    from posttrain.models.loading import enable_checkpointing, load_causal_lm, load_tokenizer, resolve_dtype
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer

    if section.path is not None:
        model = load_causal_lm(section.path, dtype=section.dtype, gradient_checkpointing=section.gradient_checkpointing)
        tokenizer = load_tokenizer(section.path)
    else:
        spec = section.tiny
        tokenizer = build_char_tokenizer()
        model = build_tiny_causal_lm(
            len(tokenizer),
            arch=spec.arch,
            layers=spec.layers,
            hidden=spec.hidden,
            heads=spec.heads,
            intermediate=spec.intermediate,
            max_positions=spec.max_positions,
            seed=seed,
            tokenizer=tokenizer,
        )
        # the same two options a loaded model takes (load_causal_lm), so a tiny run can test them
        model = model.to(resolve_dtype(section.dtype))
        if section.gradient_checkpointing:
            enable_checkpointing(model)
    return with_lora(model, section), tokenizer


def with_lora(model: Any, section: ModelSection) -> Any:
    """``model`` wrapped with the adapters ``model.lora`` asks for (unchanged without it)."""
    if section.lora is None:
        return model
    from posttrain.models.lora import apply_lora

    lora = section.lora
    try:
        return apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)
    except ValueError as error:  # peft: no module matches target_modules
        layers = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.target_modules = {lora.target_modules!r} matches no layer of this model ({error}); "
            f"its linear layers: {', '.join(layers)}, or 'all-linear'"
        ) from None


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
    try:
        task = get_task(section.task, section.task_options)(section.n_train, section.n_eval, seed)
    except (DataError, UnknownNameError) as error:
        sizes = f"data.n_train = {section.n_train}, data.n_eval = {section.n_eval}"
        raise DataError(f"data.task = {section.task!r} ({sizes}): {error}") from None
    found = detect_format(list(task.train[0])) if task.train else None
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


def encode_within_context(
    objective: Any, rows: Sequence[dict], section: DataSection, held_out: bool = False, max_length: int | None = None
) -> list:
    """``objective.encode`` of every row (:func:`encode_rows`) that fits the model's context, and
    ``max_length`` when it is lower (``data/lengths.py``: refused or, with ``data.on_bad_row:
    skip``, left out)."""
    from posttrain.data.lengths import context_limit, drop_overlong

    source = data_source(section, held_out)
    examples = encode_rows(objective.encode, rows, source)
    lengths = [max(len(ids) for ids, _ in _sequences(example)) for example in examples]
    what = f"{'held-out ' if held_out else ''}rows of {source}"
    limit, limit_name = context_limit(objective.model), "the model's context"
    if max_length is not None and (limit is None or max_length < limit):
        limit, limit_name = max_length, "max_length"
    return drop_overlong(examples, lengths, limit, what=what, on_bad_row=section.on_bad_row, limit_name=limit_name)


def _sequences(example: Any) -> list[tuple[list[int], list[int]]]:
    """The token sequences of an encoded example: one (SFT), or chosen and rejected (pairs)."""
    return [example] if isinstance(example, tuple) else [example.chosen, example.rejected]


def run_sft(config: SFTRun) -> list[dict[str, float]]:
    from posttrain.data.lengths import context_limit
    from posttrain.evaluate import evaluate
    from posttrain.rewards import resolve_reward
    from posttrain.train.sft import SFTObjective

    check_run_dir(config)
    check_model_source(config.model)
    train_rows, held_out, reward_name = load_rows(config.data, config.seed, ("prompt_completion", "conversational"))
    if not config.packing:  # packed, several rows share a sequence: counted once packed
        check_enough_rows(train_rows, config.batch_size, "batch_size", config.data)

    torch.manual_seed(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
    objective = SFTObjective(model, tokenizer, packing=config.packing)
    examples = encode_within_context(objective, train_rows, config.data, max_length=config.max_length)
    if config.packing:
        examples = _packed(examples, config, context_limit(model))
    held_out = held_out if config.eval_size is None else held_out[: config.eval_size]
    # the loss on every held-out row with an answer (data.eval_path, or a task's held-out rows),
    # one row a sequence (the same loss as packed); a task's reward adds the accuracy of greedy answers
    held_objective = SFTObjective(model, tokenizer)
    held_examples = [held_objective.encode(row) for row in held_out if "completion" in row or "messages" in row]
    reward = resolve_reward(reward_name).fn if reward_name else None

    def evaluate_fn() -> dict[str, float]:
        metrics = held_out_metrics(held_objective, held_examples, micro_batch(config)) if held_examples else {}
        if reward is not None:
            result = evaluate(
                model,
                tokenizer,
                held_out,
                reward,
                max_new_tokens=config.eval_max_new_tokens,
                batch_size=config.eval_batch_size,
            )
            metrics["accuracy"] = result.accuracy
        return metrics

    return train_offline(
        objective,
        examples,
        config,
        evaluate=evaluate_fn if held_examples or (reward and held_out) else None,
        config_yaml=dump_config(config),
        progress_keys=["loss/sft", "eval/accuracy" if reward else "eval/loss"],
        label="sft",
    )


def _packed(examples: list, config: SFTRun, context: int | None) -> list:
    """The packed rows of ``examples`` (train/packing.py), refused when too few for one batch."""
    from posttrain.train.packing import pack_examples

    max_length = config.max_length or context
    if max_length is None:
        raise ConfigError("packing=true needs max_length: the model's config gives no max_position_embeddings")
    packs = pack_examples(examples, max_length, config.seed)
    if len(packs) < config.batch_size:
        raise DataError(
            f"packing {len(examples)} rows into sequences of max_length={max_length} tokens makes {len(packs)} "
            f"packed rows, fewer than batch_size={config.batch_size} (which counts packed rows): lower batch_size "
            "or max_length, or add data"
        )
    print(f"[data] packed {len(examples)} rows into {len(packs)} sequences of up to {max_length} tokens", flush=True)
    return packs


def run_reward_model(config: RewardModelRun) -> list[dict[str, float]]:
    from posttrain.models.reward import reward_model_from_policy
    from posttrain.train.preference import RewardModelObjective

    check_run_dir(config)
    check_model_source(config.model)
    train_rows, held_out, _ = load_rows(config.data, config.seed, ("preference",))
    check_enough_rows(train_rows, config.batch_size, "batch_size", config.data)

    torch.manual_seed(config.seed)
    # the adapters go on the scorer (its head then trains in full), not on the policy it copies
    policy, tokenizer = build_model_and_tokenizer(config.model.model_copy(update={"lora": None}), config.seed)
    scorer = with_lora(reward_model_from_policy(policy, tokenizer.pad_token_id), config.model)
    del policy
    objective = RewardModelObjective(scorer, tokenizer, center_coef=config.center_coef)
    held_examples = encode_within_context(objective, held_out, config.data, held_out=True)

    def evaluate_fn() -> dict[str, float]:
        return {"pairwise_accuracy": objective.pairwise_accuracy(held_examples)}

    history = train_offline(
        objective,
        encode_within_context(objective, train_rows, config.data),
        config,
        evaluate=evaluate_fn if held_examples else None,
        config_yaml=dump_config(config),
        progress_keys=["loss/rm", "rm/accuracy"],
        label="rm",
    )
    _write_summary(config.output_dir, history)
    return history


def run_dpo(config: DPORun) -> list[dict[str, float]]:
    from posttrain.train.preference import DPOObjective

    check_run_dir(config)
    check_model_source(config.model)
    train_rows, held_out, _ = load_rows(config.data, config.seed, ("preference",))
    check_enough_rows(train_rows, config.batch_size, "batch_size", config.data)

    torch.manual_seed(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
    reference_context = None
    if config.model.lora is not None:
        from posttrain.models.lora import reference_policy

        def reference_context() -> Any:
            return reference_policy(model)

    objective = DPOObjective(
        model,
        tokenizer,
        beta=config.beta,
        loss_type=config.loss_type,
        label_smoothing=config.label_smoothing,
        reference_context=reference_context,
    )
    held_examples = [objective.encode(r) for r in held_out]

    def evaluate_fn() -> dict[str, float]:  # DPO loss, implicit-reward accuracy and margins
        return held_out_metrics(objective, held_examples, micro_batch(config))

    history = train_offline(
        objective,
        encode_within_context(objective, train_rows, config.data),
        config,
        evaluate=evaluate_fn if held_examples else None,
        config_yaml=dump_config(config),
        progress_keys=["loss/dpo", "dpo/margin"],
        label="dpo",
    )
    _write_summary(config.output_dir, history)
    return history


def _write_summary(output_dir: str, history: list[dict[str, float]]) -> None:
    first, last = history[0], history[-1]
    summary = {"first_step": first, "last_step": last}
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
