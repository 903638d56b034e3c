"""Configs and entry points of ``posttrain sft | rm | dpo``: build the model and data a config
names, then hand them to the offline loop. Every option is documented once, here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from posttrain.config import Section, dump_config
from posttrain.data import read_dataset
from posttrain.data.tasks import get_task
from posttrain.train.offline import LoopConfig, held_out_metrics, train_offline


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
    intermediate: int | None = None
    """MLP width (default 4 × hidden)."""
    tokenizer: Literal["char"] = "char"
    """The tokenizer built with it: one token per character."""


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
    """A local Hugging Face model folder. When set, `tiny` is ignored."""
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
    """The run folder and resume point, checked before any model loads (``train/run_dir.py``)."""
    from posttrain.train.run_dir import start_point

    start_point(config.output_dir, config.resume, config.overwrite, dump_config(config))


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
    return apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)


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
        train, held_out = template_rows(train, template, column), template_rows(held_out, template, column)
    if section.chat_template:
        from posttrain.data.prompt_templates import chat_rows

        train, held_out = chat_rows(train, section.prompt_column), chat_rows(held_out, section.prompt_column)
    return train, held_out, reward


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
    task = get_task(section.task, section.task_options)(section.n_train, section.n_eval, seed)
    return task.train, task.held_out, task.reward


def run_sft(config: SFTRun) -> list[dict[str, float]]:
    from posttrain.evaluate import evaluate
    from posttrain.rewards import resolve_reward
    from posttrain.train.sft import SFTObjective

    check_run_dir(config)

    torch.manual_seed(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
    train_rows, held_out, reward_name = load_rows(config.data, config.seed, ("prompt_completion", "conversational"))
    objective = SFTObjective(model, tokenizer)
    examples = [objective.encode(row) for row in train_rows]
    held_out = held_out if config.eval_size is None else held_out[: config.eval_size]
    # the loss on every held-out row with an answer (data.eval_path, or a task's held-out rows);
    # a task's reward adds the accuracy of greedy answers
    held_examples = [objective.encode(row) for row in held_out if "completion" in row or "messages" in row]
    reward = resolve_reward(reward_name).fn if reward_name else None

    def evaluate_fn() -> dict[str, float]:
        metrics = held_out_metrics(objective, held_examples, micro_batch(config)) if held_examples else {}
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


def run_reward_model(config: RewardModelRun) -> list[dict[str, float]]:
    from posttrain.models.reward import reward_model_from_policy
    from posttrain.train.preference import RewardModelObjective

    check_run_dir(config)

    torch.manual_seed(config.seed)
    # the adapters go on the scorer (its head then trains in full), not on the policy it copies
    policy, tokenizer = build_model_and_tokenizer(config.model.model_copy(update={"lora": None}), config.seed)
    scorer = with_lora(reward_model_from_policy(policy, tokenizer.pad_token_id), config.model)
    del policy
    train_rows, held_out, _ = load_rows(config.data, config.seed, ("preference",))
    objective = RewardModelObjective(scorer, tokenizer, center_coef=config.center_coef)
    held_examples = [objective.encode(row) for row in held_out]

    def evaluate_fn() -> dict[str, float]:
        return {"pairwise_accuracy": objective.pairwise_accuracy(held_examples)}

    history = train_offline(
        objective,
        [objective.encode(r) for r in train_rows],
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

    torch.manual_seed(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
    train_rows, held_out, _ = load_rows(config.data, config.seed, ("preference",))
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
        [objective.encode(r) for r in train_rows],
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
