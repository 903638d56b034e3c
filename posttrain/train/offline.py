"""The one offline training loop: SFT, reward models and the DPO family are objectives of it.

An :class:`Objective` turns rows into examples and a micro-batch of examples into a loss;
the loop owns everything else — seeded data order, gradient accumulation, clipping, the
learning-rate schedule, NaN checks, metrics, checkpoints and exact resume — so each
objective is a page of maths instead of a trainer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from posttrain.data.sampler import EpochSampler
from posttrain.devices import compute_precision, model_device, precision_problem
from posttrain.distributed import world
from posttrain.errors import TrainingDiverged  # re-exported: raised here, caught by callers
from posttrain.memory import return_free_memory
from posttrain.run.checkpoint import (
    checkpoint_root,
    load_training_state,
    load_weights_into,
    save_checkpoint,
    weights_to_save,
)
from posttrain.run.out_of_memory import stage
from posttrain.run.run_options import OptimizerOptions, RunOptions
from posttrain.run.run_outputs import Silent, finish_run, on_main, ready_run_dir, report_failure, run_sinks
from posttrain.run.stopping import StopOnSignal
from posttrain.telemetry import MetricsLogger
from posttrain.train.micro_batches import example_cost, offline_passes, split_evenly
from posttrain.train.schedule import lr_multiplier
from posttrain.view.rollout_view import write_recorded_view

# what the offline loop's checkpoint state holds besides the step and RNG states (checked on resume)
OFFLINE_STATE_FIELDS = {"optimizer": dict, "scheduler": dict, "sampler": dict}


class LoopConfig(RunOptions, OptimizerOptions):
    """Options of the offline loop shared by ``sft``, ``rm`` and ``dpo``: the options every
    training command has (run/run_options.py) and the micro-batching of a step."""

    batch_size: int = Field(32, ge=1)
    """Rows per optimizer step (all micro-batches together)."""
    gradient_accumulation: int = Field(1, ge=1)
    """Micro-batches per step; batch_size must be a multiple. The loss is normalised over the
    whole step, so results do not depend on this (up to float rounding)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Tokens per forward/backward pass (rows × the longest, padding included): a step takes
    more micro-batches than gradient_accumulation when its rows need it. With it unset and
    gradient_accumulation 1, the command derives it from the memory plan and the device's memory
    (``--plan`` shows it), records it in config.yaml and checkpoints, and a resume reuses it."""

    @model_validator(mode="after")
    def _whole_micro_batches(self) -> LoopConfig:
        if self.batch_size % self.gradient_accumulation:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of gradient_accumulation "
                f"({self.gradient_accumulation})"
            )
        return self

    @model_validator(mode="after")
    def _precision_fits_the_weights(self) -> LoopConfig:
        model = getattr(self, "model", None)  # every command's config has one
        problem = precision_problem(self.precision, model.dtype) if model is not None else None
        if problem:
            raise ValueError(problem)
        return self


class Objective(Protocol):
    """What the loop needs from SFT, reward-model or DPO training."""

    model: nn.Module
    """The trained module; checkpoints save it with ``save_pretrained``."""
    tokenizer: Any
    loss_name: str
    """Metric name of the step loss, e.g. ``loss/sft``."""

    def units(self, examples: Sequence[Any]) -> float:
        """How many items (tokens, pairs) these examples contribute to the step's mean."""
        ...

    def loss(self, examples: Sequence[Any], step_units: float) -> tuple[Tensor, dict[str, float]]:
        """Loss of a micro-batch, normalised by the whole step's ``step_units`` so that the
        micro-batch losses sum to the step's mean; plus extra metrics, averaged over the
        micro-batches of the step."""
        ...


EvalFn = Callable[[], "Mapping[str, float] | tuple[Mapping[str, float], list[dict[str, Any]]]"]
"""A held-out evaluation: its metrics, or (its metrics, its answers as eval_samples.jsonl records:
prompt, completion, reward, correct), which the loop writes at the first and last evaluation."""
StepHook = Callable[[int, dict[str, float]], "bool | None"]
"""Called after each step with its number and metrics, before they are logged: it may add
metrics (an evaluation of its own) and returns True to stop training after this step (early
stopping on a validation check, a wall-time budget), which then ends as a last step does."""


def train_offline(
    objective: Objective,
    examples: Sequence[Any],
    config: LoopConfig,
    *,
    evaluate: EvalFn | None = None,
    config_yaml: str | None = None,
    progress_keys: Sequence[str] = (),
    label: str = "train",
    on_step: StepHook | None = None,
    show_progress: bool = True,
) -> list[dict[str, float]]:
    """Train ``objective.model`` on ``examples``; returns the per-step metrics. ``on_step``: see
    :data:`StepHook`; ``show_progress=False`` leaves the console to a caller printing its own lines."""
    out = Path(config.output_dir).absolute()  # fixed at the start: user code may os.chdir
    # rank 0 prepares the run folder (run_outputs.py); every rank resumes from what it found
    resume_from = ready_run_dir(out, config.resume, config.overwrite, config_yaml, fields=OFFLINE_STATE_FIELDS)
    model = objective.model
    parts = _Parts.build(model, len(examples), config)
    start_step = _maybe_resume(config, resume_from, model, parts)

    history: list[dict[str, float]] = []
    logger, progress = run_sinks(out, config, start_step, progress_keys, label, show_progress)
    signalled = StopOnSignal(world(), config.stop_grace_s).install()  # SIGTERM: stopping.py
    try:
        if evaluate is not None and start_step == 0:
            _log_eval(evaluate, logger, 0)
        model.train()
        started = time.perf_counter()
        last_step = config.steps
        for step in range(start_step + 1, config.steps + 1):
            metrics, stop = _step(objective, examples, parts, config, step, started, evaluate, on_step)
            logger.log(step, metrics)
            history.append({"step": step, **metrics})
            progress.update(step, metrics)
            last_step = step if stop else last_step
            stopping = step < last_step and signalled.stop_here()
            if (config.save_every and step % config.save_every == 0) or step == last_step or stopping:
                _save(out, step, objective, config, config_yaml, parts)
            if stopping:
                raise signalled.stopped(step, checkpoint_root(out) / f"step-{step}")
            if stop:
                break
        if evaluate is not None:  # the final evaluation, logged with the last step
            final_eval = _log_eval(evaluate, logger, last_step)
            if history:
                history[-1].update(final_eval)
        finish_run(out, objective.model, objective.tokenizer, f"posttrain {label}: {out.name}", (write_recorded_view,))
    except BaseException as error:  # the report shows what was logged up to the failure, and why
        report_failure(out, f"posttrain {label}: {out.name}", error, (write_recorded_view,))
        raise
    finally:
        signalled.restore()
        progress.close()
        logger.close()
    return history


@dataclass
class _Parts:
    """What the loop updates besides the model, and checkpoints with it."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: EpochSampler

    @classmethod
    def build(cls, model: nn.Module, num_examples: int, config: LoopConfig) -> _Parts:
        """AdamW over the trainable parameters, its schedule and the data order."""
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer, scheduler = _optimizer_and_schedule(params, config)
        return cls(params, optimizer, scheduler, EpochSampler(num_examples, config.batch_size, config.seed))

    def state_dicts(self) -> dict[str, Any]:
        return {name: getattr(self, name).state_dict() for name in ("optimizer", "scheduler", "sampler")}


def _step(
    objective: Objective,
    examples: Sequence[Any],
    parts: _Parts,
    config: LoopConfig,
    step: int,
    started: float,
    evaluate: EvalFn | None,
    on_step: StepHook | None,
) -> tuple[dict[str, float], bool]:
    """One optimizer step, its scheduled evaluation and the caller's hook: (metrics, stop)."""
    with stage("training step", step):
        metrics = _train_step(objective, examples, parts.sampler, parts.optimizer, parts.params, config, step)
    metrics["lr"] = parts.scheduler.get_last_lr()[0]
    parts.scheduler.step()
    metrics["time/elapsed_s"] = time.perf_counter() - started
    if evaluate is not None and config.eval_every and step % config.eval_every == 0 and step < config.steps:
        metrics.update(_evaluated(evaluate)[0])
    stop = bool(on_step(step, metrics)) if on_step is not None else False
    objective.model.train()  # an evaluation (scheduled or the hook's) left eval mode on
    return metrics, stop


def _log_eval(evaluate: EvalFn, logger: MetricsLogger | Silent, step: int) -> dict[str, float]:
    """Run ``evaluate``, log its metrics (``eval/`` prefixed, rank 0) and answers at ``step``, and
    return the metrics."""
    metrics, answers = _evaluated(evaluate)
    logger.log(step, metrics)
    logger.log_eval_samples(step, answers)
    return metrics


def _evaluated(evaluate: EvalFn) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(the metrics, ``eval/`` prefixed; the answers, or none) of one evaluation."""
    with stage("evaluation"):
        result = evaluate()
    metrics, answers = result if isinstance(result, tuple) else (result, [])
    return {f"eval/{k}": v for k, v in metrics.items()}, list(answers)


def _save(
    out: Path, step: int, objective: Objective, config: LoopConfig, config_yaml: str | None, parts: _Parts
) -> None:
    """The checkpoint of ``step``: the model, its tokenizer and the optimizer, schedule and data
    order, written by rank 0 (a sharded model's whole state gathered first, on every rank)."""
    ranks, model = world(), objective.model
    weights, state = weights_to_save(model), parts.state_dicts()
    state["optimizer"] = ranks.optimizer_state(model, parts.optimizer)
    on_main(
        lambda: save_checkpoint(
            out,
            step,
            model=model,
            tokenizer=objective.tokenizer,
            config_yaml=config_yaml,
            keep_last=config.keep_last,
            training_state=state,
            weights=weights,
        )
    )


def _optimizer_and_schedule(params: list[torch.nn.Parameter], config: LoopConfig) -> tuple[Any, Any]:
    """AdamW over the trainable parameters and its learning-rate schedule (``schedule.py``)."""
    optimizer = torch.optim.AdamW(
        params, lr=config.learning_rate, betas=config.adam_betas, weight_decay=config.weight_decay
    )
    multiplier = lr_multiplier(config.lr_scheduler, config.warmup_steps, config.steps, config.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


@torch.no_grad()
def held_out_metrics(objective: Objective, examples: Sequence[Any], batch_size: int) -> dict[str, float]:
    """The objective's loss and metrics over held-out ``examples``, in eval mode (no dropout),
    ``batch_size`` examples per forward pass.

    The loss is normalised by the units (tokens, pairs) of all of them, as a training step is by
    its own, so for SFT it is the token-mean NLL of the whole set, for DPO the mean over pairs;
    the objective's per-batch metrics are weighted by each batch's units. Keys drop the
    objective's prefix: ``loss``, and e.g. ``accuracy``, ``margin`` for DPO.
    """
    model = objective.model
    was_training = model.training
    model.eval()
    total_units = objective.units(examples)
    totals: dict[str, float] = {"loss": 0.0}
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        loss, metrics = objective.loss(chunk, total_units)
        totals["loss"] += float(loss)
        weight = objective.units(chunk) / total_units
        for key, value in metrics.items():
            name = key.split("/")[-1]
            totals[name] = totals.get(name, 0.0) + float(value) * weight
    model.train(was_training)
    return totals


def _micro_batches(rows: list, config: LoopConfig) -> list:
    """A step's rows in ``gradient_accumulation`` passes, or in more where ``micro_batch_tokens``
    needs them: then one count on every rank (a sharded model's passes are collectives)."""
    if config.micro_batch_tokens is None:
        micro = max(len(rows) // config.gradient_accumulation, 1)
        return [rows[i : i + micro] for i in range(0, len(rows), micro)]
    widest = max((count * length for count, length in map(example_cost, rows)), default=1)
    passes = world().most(offline_passes(len(rows), widest, config.gradient_accumulation, config.micro_batch_tokens))
    return list(split_evenly(rows, min(passes, len(rows)) or 1))


def _train_step(
    objective: Objective,
    examples: Sequence[Any],
    sampler: EpochSampler,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    config: LoopConfig,
    step: int,
) -> dict[str, float]:
    ranks = world()
    # this rank's share of the step's rows (all of them in one process), in as many micro-batches
    rows = ranks.share([examples[i] for i in sampler.next_batch()])
    chunks = _micro_batches(rows, config)
    # normalised by the whole step's units over the ranks: the summed gradients are one process's
    step_units = ranks.sum(sum(objective.units(chunk) for chunk in chunks))
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {objective.loss_name: 0.0}
    device = model_device(objective.model)
    for chunk in chunks:
        with compute_precision(config.precision, device):  # bf16: the forward passes; the loss stays float32
            loss, metrics = objective.loss(chunk, step_units)
        loss = loss.float()
        if not torch.isfinite(loss):
            raise TrainingDiverged(
                f"step {step}: the loss is {loss.item()}; the last complete checkpoint is kept. "
                f"Lower learning_rate (now {config.learning_rate:g}) or check the data of this batch."
            )
        loss.backward()
        totals[objective.loss_name] += loss.item()  # micro-batch losses sum to the step mean
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value) / len(chunks)
    ranks.sum_gradients(params)
    totals = {**ranks.mean(totals), objective.loss_name: ranks.sum(totals[objective.loss_name])}
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not math.isfinite(grad_norm):
        raise TrainingDiverged(f"step {step}: the gradient norm is {grad_norm}; lower learning_rate")
    optimizer.step()
    return_free_memory(device.type)  # this step's activations, which glibc would otherwise keep (posttrain.memory)
    return {**totals, "grad_norm": grad_norm}


def _maybe_resume(config: LoopConfig, path: Path | None, model: nn.Module, parts: _Parts) -> int:
    """Restore everything from checkpoint ``path``; return its step (0 for a fresh start)."""
    if path is None:
        torch.manual_seed(config.seed)
        return 0
    load_weights_into(model, path)
    state = load_training_state(path, OFFLINE_STATE_FIELDS)
    world().load_optimizer_state(model, parts.optimizer, state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.sampler.load_state_dict(state["sampler"])
    print(f"[resume] step {state['step']} restored from {path}", flush=True)
    return int(state["step"])
