"""Configs and entry points of ``posttrain sft | rm | dpo``: build the model and data a config
names, then hand them to the offline loop. Every option is documented once, here."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import Field, model_validator

from posttrain.config import ConfigError, dump_config
from posttrain.data import DataError
from posttrain.data.section import (  # re-exported: the config sections' historical home
    DataSection,
    check_enough_rows,
    data_source,
    encode_rows,
    load_rows,
)
from posttrain.devices import resolve_device
from posttrain.distributed import join, note_strategy, world
from posttrain.models.section import (  # re-exported, as above
    LoraSection,
    ModelSection,
    TinyModel,
    build_model_and_tokenizer,
    check_model_source,
    with_lora,
)
from posttrain.run.run_outputs import held_out_records
from posttrain.train.offline import OFFLINE_STATE_FIELDS, LoopConfig, held_out_metrics, train_offline

__all__ = [
    "DPORun",
    "DataSection",
    "LoraSection",
    "ModelSection",
    "RewardModelRun",
    "SFTRun",
    "TinyModel",
    "build_model_and_tokenizer",
    "check_enough_rows",
    "check_model_source",
    "data_source",
    "encode_rows",
    "load_rows",
    "run_dpo",
    "run_reward_model",
    "run_sft",
    "with_lora",
]

T = TypeVar("T")


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
    and attention stays within each example (a pass's rows run end to end in one row and the
    attention kernel takes the examples' offsets: no mask is built; train/packing.py), and the loss stays the
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
    nll_coef: float = Field(0.0, ge=0)
    """Weight α of the chosen responses' NLL per token added to the loss (RPO; TRL's
    ``rpo_alpha``, the paper's 1.0; Llama 3 used 0.2): keeps the preferred answers likely while
    the margin grows. 0 is plain DPO."""

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
    """The run folder and resume point (``run/run_dir.py``), the metric sinks and whether the model
    can pack (``packing``), checked before any model loads (the folder by rank 0 alone under
    torchrun: it writes the folder)."""
    from posttrain.models.packing import check_packable
    from posttrain.run.run_dir import start_point
    from posttrain.telemetry.metrics import check_report_to

    if world().is_main:
        config_yaml = dump_config(config)
        start_point(config.output_dir, config.resume, config.overwrite, config_yaml, config.steps, OFFLINE_STATE_FIELDS)
    check_report_to(config.report_to)
    if getattr(config, "packing", False):
        check_packable(config.model.path, "packing")


def _device(config: LoopConfig) -> torch.device:
    """The run's device (checked before anything loads); under torchrun the process group is
    joined here and a CUDA run takes this rank's own GPU (``distributed.py``)."""
    device = resolve_device(config.device)
    ranks = join(device)
    ranks.share(range(config.batch_size))  # refused here, before loading, when it does not divide
    ranks.same_everywhere(config.micro_batch_tokens, "micro_batch_tokens")
    note_strategy(config.strategy)
    return ranks.device(device)


def encode_within_context(
    objective: Any, rows: Sequence[dict], section: DataSection, held_out: bool = False, max_length: int | None = None
) -> list:
    """``objective.encode`` of every row (:func:`encode_rows`) that fits the model's context, and
    ``max_length`` when it is lower (``data/lengths.py``: refused or, with ``data.on_bad_row:
    skip``, left out)."""
    from posttrain.data.lengths import context_limit, drop_overlong

    source = data_source(section, held_out)
    limit, limit_name = context_limit(objective.model), "the model's context"
    if max_length is not None and (limit is None or max_length < limit):
        limit, limit_name = max_length, "max_length"
    examples = encode_rows(partial(objective.encode, max_tokens=limit), rows, source)
    lengths = [max(len(ids) for ids, _ in _sequences(example)) for example in examples]
    what = f"{'held-out ' if held_out else ''}rows of {source}"
    return drop_overlong(examples, lengths, limit, what=what, on_bad_row=section.on_bad_row, limit_name=limit_name)


def _sequences(example: Any) -> list[tuple[list[int], list[int]]]:
    """The token sequences of an encoded example: one (SFT), or chosen and rejected (pairs)."""
    return [example] if isinstance(example, tuple) else [example.chosen, example.rejected]


def run_sft(config: SFTRun) -> list[dict[str, float]]:
    from posttrain.data.lengths import context_limit
    from posttrain.evaluate import evaluate
    from posttrain.rewards import resolve_reward
    from posttrain.train.sft import SFTObjective

    device = _device(config)
    check_run_dir(config)
    check_model_source(config.model)
    train_rows, held_out, reward_name = load_rows(config.data, config.seed, ("prompt_completion", "conversational"))
    if not config.packing:  # packed, several rows share a sequence: counted once packed
        check_enough_rows(train_rows, config.batch_size, "batch_size", config.data)

    torch.manual_seed(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
    model = world().shard(model.to(device), config.strategy)  # FSDP2 under torchrun (distributed.py)
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

    def evaluate_fn() -> tuple[dict[str, float], list[dict[str, Any]]]:
        metrics = held_out_metrics(held_objective, held_examples, micro_batch(config)) if held_examples else {}
        if reward is None:
            return metrics, []
        result = evaluate(
            model,
            tokenizer,
            held_out,
            reward,
            max_new_tokens=config.eval_max_new_tokens,
            batch_size=config.eval_batch_size,
        )
        metrics["accuracy"] = result.accuracy
        return metrics, held_out_records(result)  # the greedy answers, marked, in eval_samples.jsonl

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

    device = _device(config)
    check_run_dir(config)
    check_model_source(config.model)
    train_rows, held_out, _ = load_rows(config.data, config.seed, ("preference",))
    check_enough_rows(train_rows, config.batch_size, "batch_size", config.data)

    torch.manual_seed(config.seed)
    # the adapters go on the scorer (its head then trains in full), not on the policy it copies
    policy, tokenizer = build_model_and_tokenizer(config.model.model_copy(update={"lora": None}), config.seed)
    scorer = with_lora(reward_model_from_policy(policy, tokenizer.pad_token_id), config.model).to(device)
    scorer = world().shard(scorer, config.strategy)
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

    device = _device(config)
    check_run_dir(config)
    check_model_source(config.model)
    train_rows, held_out, _ = load_rows(config.data, config.seed, ("preference",))
    check_enough_rows(train_rows, config.batch_size, "batch_size", config.data)

    torch.manual_seed(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
    model = model.to(device)  # before the reference copies it
    reference, reference_context = None, None
    if config.model.lora is None:  # a frozen copy of the initial policy, sharded like it under FSDP2
        reference = world().shard(copy.deepcopy(model).eval().requires_grad_(False), config.strategy)
        model = world().shard(model, config.strategy)
    else:  # the policy with its adapters off (models/lora.py), sharded with it
        from posttrain.models.lora import reference_policy

        model = world().shard(model, config.strategy)

        def reference_context() -> Any:
            return reference_policy(model)

    objective = DPOObjective(
        model,
        tokenizer,
        beta=config.beta,
        loss_type=config.loss_type,
        label_smoothing=config.label_smoothing,
        nll_coef=config.nll_coef,
        reference=reference,
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


def _write_summary(output_dir: str | Path, history: list[dict[str, float]]) -> None:
    first, last = history[0], history[-1]
    summary = {"first_step": first, "last_step": last}
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
