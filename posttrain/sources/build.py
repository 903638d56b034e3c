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
from posttrain.distributed import world
from posttrain.rewards import RewardSet
from posttrain.rollout.engine import build_engine
from posttrain.rollout.process_engine import ProcessEngine
from posttrain.rollout.weight_mailbox import ThreadMailbox
from posttrain.sources import RolloutSource
from posttrain.sources.async_producer import AsyncProducer, rollout_copy
from posttrain.sources.environment import EnvironmentSource
from posttrain.sources.recorded import RecordingSource, ReplaySource, run_shape
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
    # (with a sharded policy, by the engine's whole copy of it: rollout/gathered.py)
    evaluation: Any = HeldOutCompletions(getattr(engine, "whole_model", policy), tokenizer, rewards, config)
    if config.rollout.replay is not None:
        source = ReplaySource(config.rollout.replay)
    elif config.rollout.max_staleness:
        source = asynchronous(config, policy, tokenizer, sampling_with, echo)
        if config.env is not None:
            evaluation = sampling_with(engine)
    else:
        source = sampling_with(engine)
        if config.env is not None:
            evaluation = source
    if config.record_rollouts:
        source = RecordingSource(source, output_dir / "rollouts", run_shape(config))
    return source, evaluation


def learner_engine(config: RLRun, policy: nn.Module, tokenizer: Any, echo: Callable[[str], None]) -> Any:
    """The engine over the trained policy itself: it samples the synchronous loop's batches (on
    the Ray workers with ``cluster.kind: ray``); with ``rollout.max_staleness`` the producer has
    its own (:func:`asynchronous`) and this one, local, only plays evaluation episodes."""
    if config.rollout.max_staleness:
        return build_engine(policy, tokenizer, kind=config.engine_kind, vllm_options=config.rollout.vllm)
    if config.strategy == "fsdp2" and world().size > 1:  # the policy is sharded next (rl.py)
        from posttrain.rollout.gathered import GatheredEngine
        from posttrain.sources.async_producer import rollout_copy

        return GatheredEngine(policy, rollout_copy(policy), tokenizer, config.engine_kind)
    return rollout_engine(config, policy, tokenizer, echo)


def rollout_engine(
    config: RLRun, model: nn.Module, tokenizer: Any, echo: Callable[[str], None], mailbox: Any = None
) -> Any:
    """The engine that samples with ``model``: a local one (``rollout.engine``), or with
    ``cluster.kind: ray`` the Ray rollout workers (``rollout/ray_engine.py``)."""
    if config.cluster.kind == "ray":
        from posttrain.rollout.ray_engine import RayEngine

        return RayEngine(model, tokenizer, config.cluster, config.engine_kind, echo)
    return build_engine(model, tokenizer, kind=config.engine_kind, vllm_options=config.rollout.vllm, mailbox=mailbox)


def reward_pool(config: RLRun) -> Any:
    """What runs the reward workers' tasks: None (the local worker processes), or with
    ``cluster.kind: ray`` Ray tasks on the cluster (``rewards/ray_pool.py``)."""
    if config.cluster.kind != "ray":
        return None
    from posttrain.rewards.ray_pool import RayTaskPool

    return RayTaskPool


def stop_workers(engine: Any) -> None:
    """At the end of a run, stop the Ray rollout workers of the learner's engine (and a local
    cluster started for them; the asynchronous producer stops its own); a local or vLLM engine
    stays usable, for a caller sampling after ``run()``."""
    from posttrain.rollout.ray_engine import RayEngine

    if isinstance(engine, RayEngine):
        engine.close()


def check_placement(config: RLRun, device: torch.device, processes: int) -> None:
    """Refuse, before any model loads, where rollouts cannot be generated: Ray not installed, Ray
    workers under torchrun, an asynchronous producer process off the CPU (:func:`producer_kind`)."""
    if config.cluster.kind == "ray":
        from posttrain.rollout.ray_engine import import_ray

        import_ray()
        if processes > 1:
            raise ConfigError(
                f"cluster.kind = 'ray' places the rollout workers from one learner process; torchrun started "
                f"{processes}: run it as one process (python -m posttrain rl ...), or leave cluster.kind: local"
            )
    producer_kind(config, device)


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
    config: RLRun,
    policy: nn.Module,
    tokenizer: Any,
    sampling_with: Callable[[Any], RolloutSource],
    echo: Callable[[str], None] = print,
) -> AsyncProducer:
    """The producer of ``rollout.max_staleness``: the source ``sampling_with`` builds on an engine
    over a copy of the policy (in a child process, or in the producer thread), never the trained
    module; the producer gets ``rollout.producer_threads`` (half of the threads by default)."""
    rollout = config.rollout
    rollout_model = rollout_copy(policy)
    threads = rollout.producer_threads or max(1, torch.get_num_threads() // 2)
    # rollout.interrupt: the trained parameters may be offered to a generation in flight
    offered = [name for name, p in policy.named_parameters() if p.requires_grad] if rollout.interrupt else []
    if config.cluster.kind == "ray":  # the producer thread hands the batches to the Ray workers
        engine: Any = rollout_engine(config, rollout_model, tokenizer, echo)
    elif producer_kind(config, model_device(policy)) == "process":
        engine = ProcessEngine(rollout_model, tokenizer, config.engine_kind, threads, interruptible=offered)
    else:
        mailbox = ThreadMailbox() if offered else None
        engine = rollout_engine(config, rollout_model, tokenizer, echo, mailbox=mailbox)
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
