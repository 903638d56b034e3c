"""The wiring of the RL loop's batches: which rollout source a run's config names, the data-side
features composed over it, and what evaluates its held-out rows.

The loop (``train/rl.py``) calls :func:`build_source` once and never asks again where its
batches come from: a recording (``rollout.replay``), or an environment's episodes (``env``) or
single-turn completions, each wrapped by the data-side features the config asks for
(:func:`data_side`: overlong shaping, the reward summary, the curriculum, dynamic sampling, the
greedy baseline), after the difficulty filter chose their rows; run ahead of the learner by the
asynchronous producer with ``rollout.max_staleness`` ≥ 1; written to ``rollouts/`` with
``record_rollouts``. The sources sit below the loop and take the config sections they read and
a :class:`~posttrain.sources.plan.SamplingPlan` made here, never the run config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.algos import BASELINES
from posttrain.config import ConfigError
from posttrain.data.difficulty import DifficultyFilter
from posttrain.data.lengths import context_limit
from posttrain.devices import model_device
from posttrain.distributed import world
from posttrain.rewards import RewardSet
from posttrain.rollout.engine import build_engine
from posttrain.rollout.process_engine import ProcessEngine
from posttrain.rollout.weight_mailbox import ThreadMailbox
from posttrain.sources import RolloutSource
from posttrain.sources.async_producer import AsyncProducer, rollout_copy
from posttrain.sources.curriculum import Curriculum
from posttrain.sources.difficulty_filter import filter_by_difficulty
from posttrain.sources.dynamic_sampling import DynamicSampling
from posttrain.sources.environment import EnvironmentSource
from posttrain.sources.greedy_baseline import GreedyBaseline
from posttrain.sources.held_out import HeldOutCompletions
from posttrain.sources.overlong import OverlongShaping
from posttrain.sources.plan import SamplingPlan
from posttrain.sources.recorded import RecordingSource, ReplaySource, run_shape
from posttrain.sources.reward_metrics import ScoreMetrics
from posttrain.sources.single_turn import SingleTurnSource
from posttrain.train.rl_config import RLRun

RECORDED_STEPS_AUTO = 200  # record_rollouts: auto records at most this many steps


def sampling_plan(config: RLRun) -> SamplingPlan:
    """What the sources read of ``config`` (sources/plan.py)."""
    return SamplingPlan(
        prompts_per_step=config.prompts_per_step,
        samples_per_prompt=config.samples_per_prompt,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature_value,
        top_p=config.sampling.top_p,
        top_k=config.sampling.top_k,
        stop=tuple(config.sampling.stop),
        seed=config.seed,
        eval_k=config.eval_k,
        eval_batch_size=config.eval_batch_size,
        sampling_mask=config.rollout.keep_sampling_mask,
    )


def build_source(
    config: RLRun,
    policy: nn.Module,
    engine: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    rewards: RewardSet | None,
    output_dir: Path,
    echo: Callable[[str], None],
) -> tuple[RolloutSource, Any, DifficultyFilter | None]:
    """(the run's source, its held-out evaluation, the difficulty filter when ``data.filter`` chose
    the rows). ``engine`` samples with ``policy`` itself; the asynchronous producer gets its own copy
    and engine (:func:`asynchronous`)."""
    plan, limit = sampling_plan(config), context_limit(policy)

    def sampling(rollout_engine: Any, chosen: Sequence[dict[str, Any]]) -> Any:
        if config.env is not None:
            return EnvironmentSource(plan, config.env, rollout_engine, tokenizer, chosen, rewards, limit, echo)
        return SingleTurnSource(plan, config.data, rollout_engine, tokenizer, chosen, rewards, limit, echo)

    # held-out rows are evaluated by the policy now, in the learner's thread: greedy completions
    # (with a sharded policy, by the engine's whole copy of it: rollout/gathered.py), or greedy episodes
    evaluation: Any = (
        sampling(engine, rows)
        if config.env is not None
        else HeldOutCompletions(
            getattr(engine, "whole_model", policy), tokenizer, rewards, plan, config.data.prompt_column
        )
    )
    data_filter = None
    if config.data.filter is not None:  # measured by the evaluation: k sampled completions or episodes per row
        resuming = config.resume != "none"
        rows, data_filter = filter_by_difficulty(
            evaluation, rows, config.data.filter, output_dir, resuming, config.prompts_per_step, echo
        )

    def sampling_with(rollout_engine: Any) -> RolloutSource:
        return data_side(config, sampling(rollout_engine, rows), echo)

    source: RolloutSource
    if config.rollout.replay is not None:
        source = ReplaySource(config.rollout.replay)
    elif config.rollout.max_staleness:
        source = asynchronous(config, policy, tokenizer, sampling_with, echo)
    else:
        source = sampling_with(engine)
    if config.record_rollouts:
        every = 1 if config.record_rollouts is True else -(-config.steps // RECORDED_STEPS_AUTO)
        source = RecordingSource(source, output_dir / "rollouts", run_shape(config), every)
    return source, evaluation, data_filter


def data_side(config: RLRun, source: Any, echo: Callable[[str], None]) -> Any:
    """``source`` wrapped by the data-side features ``config`` asks for, each one module of
    ``sources/``: those acting on every draw innermost (overlong shaping, then the reward summary
    of the shaped scores, then the curriculum reading them), those acting on the step's batch
    around them (dynamic sampling's further draws, then the greedy baseline of what is kept)."""
    algo = config.algorithm
    if algo.overlong.enabled:
        source = OverlongShaping(source, algo.overlong)
    source = ScoreMetrics(source)
    if config.data.curriculum is not None:
        source = Curriculum(source, config.data.curriculum, config.prompts_per_step, config.seed)
    if algo.dynamic_sampling.enabled:
        here = config.prompts_per_step // world().size  # this rank's share of a step's groups
        source = DynamicSampling(source, algo.dynamic_sampling, config.prompts_per_step, here, echo)
    if BASELINES.needs[algo.baseline].plays_greedy:
        source = GreedyBaseline(source)
    return source


def learner_engine(config: RLRun, policy: nn.Module, tokenizer: Any, echo: Callable[[str], None]) -> Any:
    """The engine over the trained policy itself: it samples the synchronous loop's batches (on
    the Ray workers with ``cluster.kind: ray``); with ``rollout.max_staleness`` the producer has
    its own (:func:`asynchronous`) and this one, local, only plays evaluation episodes."""
    if config.strategy == "fsdp2" and world().size > 1:  # the policy is sharded next (rl.py)
        from posttrain.rollout.gathered import GatheredEngine

        whole = rollout_copy(policy)
        return GatheredEngine(policy, whole, _engine_over(config, whole, tokenizer, echo))
    return _engine_over(config, policy, tokenizer, echo)


def _engine_over(config: RLRun, model: nn.Module, tokenizer: Any, echo: Callable[[str], None]) -> Any:
    if config.rollout.max_staleness:  # it evaluates only: a local engine, current without a sync
        kind = "auto" if config.engine_kind == "vllm" else config.engine_kind
        return build_engine(model, tokenizer, kind=kind, **engine_options(config))
    return rollout_engine(config, model, tokenizer, echo)


def rollout_engine(
    config: RLRun, model: nn.Module, tokenizer: Any, echo: Callable[[str], None], mailbox: Any = None
) -> Any:
    """The engine that samples with ``model``: a local one (``rollout.engine``), or with
    ``cluster.kind: ray`` the Ray rollout workers (``rollout/ray_engine.py``)."""
    if config.cluster.kind == "ray":
        from posttrain.rollout.ray_engine import RayEngine

        # with rollout.interrupt it is the producer's: offered each version as the learner makes it
        return RayEngine(
            model, tokenizer, config.cluster, config.engine_kind, echo, config.rollout.interrupt, engine_options(config)
        )
    return build_engine(model, tokenizer, kind=config.engine_kind, mailbox=mailbox, **engine_options(config))


def engine_options(config: RLRun) -> dict[str, Any]:
    """How a local engine decodes: vLLM's options, CUDA graphs, a compiled step, and with
    ``precision: bf16`` in bfloat16 copies of the weights (refreshed with every update; the
    trainer keeps float32)."""
    rollout = config.rollout
    dtype = torch.bfloat16 if config.precision == "bf16" else None
    return {
        "vllm_options": rollout.vllm,
        "cuda_graphs": rollout.cuda_graphs,
        "compile_step": rollout.compile_step,
        "dtype": dtype,
    }


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
    from posttrain.rollout.gathered import GatheredEngine
    from posttrain.rollout.ray_engine import RayEngine

    if isinstance(engine, RayEngine | GatheredEngine):
        engine.close()


def check_placement(config: RLRun, device: torch.device) -> None:
    """Refuse, before any model loads, where rollouts cannot be generated: Ray not installed, an
    asynchronous producer process off the CPU (:func:`producer_kind`)."""
    if config.cluster.kind == "ray":
        from posttrain.rollout.ray_engine import import_ray

        import_ray()
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
        engine = ProcessEngine(
            rollout_model, tokenizer, config.engine_kind, threads, interruptible=offered, options=engine_options(config)
        )
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
