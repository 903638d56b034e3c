"""Which rollout source a run's config names, and what evaluates its held-out rows.

The loop (``train/rl.py``) calls :func:`build_source` once and never asks again where its
batches come from: a recording (``rollout.replay``), an environment's episodes (``env``) or
single-turn completions; run ahead of the learner by the asynchronous producer with
``rollout.max_staleness`` ≥ 1; written to ``rollouts/`` with ``record_rollouts``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.config import ConfigError
from posttrain.data.lengths import context_limit
from posttrain.devices import model_device
from posttrain.rewards import RewardSet
from posttrain.rollout.engine import build_engine
from posttrain.rollout.process_engine import ProcessEngine
from posttrain.rollout.weight_mailbox import ThreadMailbox
from posttrain.sources import RolloutSource
from posttrain.sources.async_producer import AsyncProducer, rollout_copy
from posttrain.sources.environment import EnvironmentSource
from posttrain.sources.recorded import RecordingSource, ReplaySource
from posttrain.sources.single_turn import SingleTurnSource
from posttrain.train.rl_config import RLRun
from posttrain.train.rl_eval import HeldOutCompletions


def build_source(
    config: RLRun,
    policy: nn.Module,
    engine: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    rewards: RewardSet | None,
    output_dir: Path,
    echo: Callable[[str], None],
) -> tuple[RolloutSource, Any]:
    """(the run's source, its held-out evaluation). ``engine`` samples with ``policy`` itself;
    the asynchronous producer gets its own copy and engine (:func:`asynchronous`)."""
    limit = context_limit(policy)

    def sampling_with(rollout_engine: Any) -> RolloutSource:
        if config.env is not None:
            return EnvironmentSource(config, config.env, rollout_engine, tokenizer, rows, rewards, limit, echo)
        return SingleTurnSource(config, rollout_engine, tokenizer, rows, rewards, limit, echo)

    source: RolloutSource
    # held-out rows are evaluated by the policy now, in the learner's thread: greedy completions,
    # or an environment source's own greedy episodes
    evaluation: Any = HeldOutCompletions(policy, tokenizer, rewards, config)
    if config.rollout.replay is not None:
        source = ReplaySource(config.rollout.replay)
    elif config.rollout.max_staleness:
        source = asynchronous(config, policy, tokenizer, sampling_with)
        if config.env is not None:
            evaluation = sampling_with(engine)
    else:
        source = sampling_with(engine)
        if config.env is not None:
            evaluation = source
    if config.record_rollouts:
        source = RecordingSource(source, output_dir / "rollouts")
    return source, evaluation


def producer_kind(config: RLRun, device: torch.device) -> str:
    """``rollout.producer`` resolved for ``device`` ("auto": a process on the CPU, else a thread);
    a process on another device is refused (its weights are shared through CPU memory)."""
    kind = config.rollout.producer
    if kind == "auto":
        return "process" if device.type == "cpu" else "thread"
    if kind == "process" and device.type != "cpu" and config.rollout.max_staleness:
        raise ConfigError(
            f"rollout.producer = 'process' shares the policy's weights through CPU shared memory; the run is on "
            f"{device}: set rollout.producer: thread (or auto)"
        )
    return kind


def asynchronous(
    config: RLRun, policy: nn.Module, tokenizer: Any, sampling_with: Callable[[Any], RolloutSource]
) -> AsyncProducer:
    """The producer of ``rollout.max_staleness``: the source ``sampling_with`` builds on an engine
    over a copy of the policy (in a child process, or in the producer thread), never the trained
    module; the producer gets ``rollout.producer_threads`` (half of the threads by default)."""
    rollout = config.rollout
    rollout_model = rollout_copy(policy)
    threads = rollout.producer_threads or max(1, torch.get_num_threads() // 2)
    # rollout.interrupt: the trained parameters may be offered to a generation in flight
    offered = [name for name, p in policy.named_parameters() if p.requires_grad] if rollout.interrupt else []
    if producer_kind(config, model_device(policy)) == "process":
        engine: Any = ProcessEngine(rollout_model, tokenizer, config.engine_kind, threads, interruptible=offered)
    else:
        mailbox = ThreadMailbox() if offered else None
        engine = build_engine(rollout_model, tokenizer, kind=config.engine_kind, mailbox=mailbox)
    return AsyncProducer(
        sampling_with(engine),
        rollout_model,
        policy,
        max_staleness=rollout.max_staleness,
        steps=config.steps,
        producer_threads=threads,
        engine=engine,
        interrupt=rollout.interrupt,
    )
