"""The one online RL loop (seed 000): generate a group per prompt → score → advantages →
clipped policy-gradient updates → the next batch samples from the updated weights.

Every algorithm of docs/algorithms.md is a setting of this loop, chosen by registry names in the
config (``posttrain.train.rl_config``), never a subclass:

    rollout      engine.generate(prompts, n = samples_per_prompt)            rollout/
    reward       RewardSet.score → scores [B], components [B, K]             rewards/
    reference    ℓ_ref when a KL is placed (frozen initial copy, or LoRA off)
    critic       V(s_t) when the estimator is gae
    shaping      r_t = 1[t = last]·score (− β·kl_t when the KL is in the reward)
    advantages   ADVANTAGE_ESTIMATORS[algorithm.advantage]                   algos/
    update       ppo_epochs × minibatches of POLICY_LOSSES[algorithm.policy_loss]
                 (+ β·agg(kl) in the loss, − c_ent·agg(H)), clipped AdamW steps

The policy is shared with the rollout engine by reference (colocated, no weight copy); the
engine is told the new version after each step (vLLM, which keeps its own copy, is handed the
new weights then, and its log-probs are compared with the trainer's: rollout/mismatch_kl).
Rollout, reward and update only exchange tensors and lists
(:class:`~posttrain.rollout.batch.RolloutBatch`), so each can move to another process later.

``torchrun --nproc_per_node N -m posttrain rl ...`` runs the same loop in N processes: each
generates and scores its share of the step's groups (the sources), the shares are gathered in
batch preparation, each updates with its share of every minibatch and the gradients are summed
(rl_prepare.py, rl_update.py, distributed.py); rank 0 alone writes the run (run_outputs.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import BASELINES
from posttrain.config import ConfigError, dump_config
from posttrain.data import DataError
from posttrain.data.section import check_enough_rows, load_rows
from posttrain.devices import resolve_device
from posttrain.distributed import world
from posttrain.memory import return_free_memory
from posttrain.models.section import build_model_and_tokenizer
from posttrain.models.value import critic_for
from posttrain.rewards import NamedReward, RewardSet
from posttrain.rewards.hacking_alarm import HackingAlarm
from posttrain.rewards.registry import resolve_rewards
from posttrain.rollout.batch import RolloutBatch
from posttrain.run.checkpoint import checkpoint_root
from posttrain.run.out_of_memory import stage
from posttrain.run.run_outputs import (
    WarningTape,
    finish_run,
    held_out_records,
    logged_samples,
    on_main,
    ready_run_dir,
    report_failure,
    run_sinks,
)
from posttrain.run.stopping import StopOnSignal
from posttrain.sources import RolloutSource
from posttrain.train.rl_checkpoint import resume_rl, rl_state_fields, save_rl_checkpoint
from posttrain.train.rl_checks import StepWarnings, check_before_loading, preflight_rewards
from posttrain.train.rl_config import RLRun
from posttrain.train.rl_prepare import (
    BatchPreparer,
    build_kl_controller,
    sequence_logprobs,
)
from posttrain.train.rl_sources import build_source, learner_engine, reward_pool, stop_workers
from posttrain.train.rl_update import PolicyUpdate
from posttrain.view.rollout_view import write_recorded_view

Echo = Callable[[str], None]
PROGRESS_KEYS = ("reward/mean", "eval/accuracy", "loss/policy", "kl/ref", "response/length_mean")


class OnlineRL:
    """State of one RL run: policy, reference, critic, engine, optimizers, data order, controllers.

    ``run()`` is the loop; ``step()`` one iteration of it, usable from Python. Built from an
    :class:`RLRun` config; ``model``/``tokenizer`` and ``reward_functions`` may be given
    directly by Python callers (they replace ``config.model`` / ``config.rewards``).
    """

    def __init__(
        self,
        config: RLRun,
        *,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        reward_functions: Sequence[Callable[..., Any] | NamedReward] | None = None,
        train_rows: Sequence[dict[str, Any]] | None = None,
        held_out_rows: Sequence[dict[str, Any]] | None = None,
        echo: Echo = print,
    ) -> None:
        # every line the run prints goes through the tape: it keeps the warnings for the report
        self.config, self.algo, self.echo = config, config.algorithm, WarningTape(echo)
        check_before_loading(config, model_given=model is not None)
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        train_rows, task_reward = self._read_data(train_rows, held_out_rows)
        self.rewards = self._reward_set(self._resolve_rewards(reward_functions, task_reward))

        torch.manual_seed(config.seed)  # the policy's initial weights do not depend on the rewards built
        if model is None:
            model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
        # every model of the run is made from the policy, on its device (devices.py)
        self.ranks = world()  # one process, or this one's place under torchrun (distributed.py)
        self.policy, self.tokenizer = model.to(self.ranks.device(resolve_device(config.device))), tokenizer
        self.policy.train()
        self.out = Path(config.output_dir).absolute()  # fixed at the start: user code may os.chdir
        self.alarm = self.rewards and HackingAlarm.for_run(
            self.rewards.names, self.rewards_weights, config.monitor_window, self.echo,
            self.out if self.ranks.is_main else None,
        )  # fmt: skip

        # models around the policy
        self.reference = self._build_reference() if self.algo.kl.needs_reference else None
        # the value model: the policy's body with a fresh scalar head, or a given folder's; light, through
        # adapters, with model.lora (models/value.py)
        self.critic = (
            None
            if self.algo.critic is None
            else critic_for(self.policy, self.algo.critic.init_from, config.critic_adapters)
        )
        self.engine = learner_engine(config, self.policy, tokenizer, self.echo)
        self.source, self.evaluation = self._build_source(train_rows)

        self.kl_controller = build_kl_controller(self.algo.kl)
        self.running_baseline = BASELINES[self.algo.baseline]()  # kept by the loop, or None (algos/returns.py)
        self.step_count = 0
        self.warnings = StepWarnings(self.echo, max_new_tokens=config.max_new_tokens)
        # strategy fsdp2 under torchrun: sharded from here on (the engine generates with a whole copy)
        models = tuple(self.ranks.shard(m, config.strategy) for m in (self.policy, self.reference, self.critic))
        self.policy, self.reference, self.critic = models
        # the step's two stages after the source: preparation, then the update
        self.preparer = BatchPreparer(config, *models, self.kl_controller, self.running_baseline, self.rewards_weights)
        self.updater = PolicyUpdate(config, self.policy, self.critic, self.kl_controller)
        # the optimisation state, checkpointed with the run
        self.optimizer, self.scheduler = self.updater.optimizer, self.updater.scheduler
        self.critic_optimizer = self.updater.critic_optimizer

    def _read_data(
        self, train_rows: Sequence[dict[str, Any]] | None, held_out_rows: Sequence[dict[str, Any]] | None
    ) -> tuple[Sequence[dict[str, Any]], str | None]:
        """(the training rows, the name of the task's own reward): rows with a prompt, any other
        column reaching the reward functions; the held-out rows kept for evaluation."""
        config, task_reward = self.config, None
        if train_rows is None:
            train_rows, held, task_reward = load_rows(config.data, config.seed)
            held_out_rows = held if held_out_rows is None else held_out_rows
        self.rows = list(train_rows)
        check_enough_rows(self.rows, config.prompts_per_step, "prompts_per_step", config.data)
        self.held_out = list(held_out_rows or [])[: config.eval_size]
        self.prompt_column = config.data.prompt_column
        # an environment starts an episode from the whole row: no prompt column needed
        missing = [i for i, row in enumerate(self.rows) if self.prompt_column not in row and config.env is None]
        if missing:
            raise DataError(f"data row {missing[0]} has no {self.prompt_column!r} column (data.prompt_column)")
        return train_rows, task_reward

    # ------------------------------------------------------------------ construction
    def _build_source(self, rows: Sequence[dict[str, Any]]) -> tuple[RolloutSource, Any]:
        """Where the batches come from and what evaluates the held-out rows (train/rl_sources.py); with
        ``data.filter``, only from the rows the starting policy solves sometimes (sources/difficulty_filter.py)."""
        args = (self.engine, self.tokenizer, rows, self.rewards, self.out, self.echo)
        source, evaluation, self.data_filter = build_source(self.config, self.policy, *args)
        if self.data_filter is not None:  # the rows trained on
            self.rows = [self.rows[i] for i in self.data_filter.kept]
        return source, evaluation

    def _resolve_rewards(
        self, functions: Sequence[Callable[..., Any] | NamedReward] | None, task_reward: str | None
    ) -> list[NamedReward]:
        config = self.config
        specs: list[Any] = list(functions) if functions is not None else list(config.rewards)
        if not specs and task_reward is None and config.env is not None:
            return []
        if not specs and task_reward is None:
            raise ConfigError(
                "no reward functions: the rows of data.path have no built-in reward; set rewards "
                "(built-in names or pkg.module:fn paths)"
            )
        return resolve_rewards(specs or [task_reward], config.reward_weights, config.allow_constant_reward)

    def _reward_set(self, named: list[NamedReward]) -> RewardSet | None:
        """The run's reward functions together; None with env and no rewards listed: the
        environment's own rewards are then the only ones."""
        if not named:
            return None
        config = self.config
        return RewardSet(
            named,
            workers=config.reward_workers,
            timeout_s=config.reward_timeout,
            max_failed_fraction=config.reward_max_failed_fraction,
            pool=reward_pool(config),  # worker processes here, or Ray tasks (cluster.kind: ray)
        )

    def _build_reference(self) -> nn.Module | None:
        """The KL anchor: the initial policy. With LoRA it is the same model with adapters
        off (no copy); otherwise a frozen copy made before any update (and before a resume
        loads trained weights)."""
        if self.config.model.lora is not None:
            return None
        reference = copy.deepcopy(self.policy).eval()
        reference.requires_grad_(False)
        return reference

    @property
    def minibatch_size(self) -> int:
        return self.config.minibatch_samples

    @property
    def recompute_old_logprobs(self) -> bool:
        return self.config.recomputes_old_logprobs

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict[str, float]]:
        """Train for ``config.steps`` steps (resuming if asked); returns per-step metrics."""
        config = self.config
        config_yaml = dump_config(config)
        fields = rl_state_fields(config)  # what its checkpoints hold: checked before the folder is touched
        checkpoint = ready_run_dir(self.out, config.resume, config.overwrite, config_yaml, self.echo, fields)
        start = resume_rl(self, checkpoint)
        if self.data_filter is not None:  # written once the folder is ready (a new run's is emptied)
            on_main(lambda: self.data_filter.save(self.out))
        history: list[dict[str, float]] = []
        logger, progress = run_sinks(self.out, config, start, PROGRESS_KEYS, "rl")
        self.echo.listen(logger)  # from here on its warnings reach warnings.jsonl
        self.source.start()  # worker start-up is not charged to the first step's reward time
        stop = StopOnSignal(self.ranks, config.stop_grace_s).install()  # SIGTERM: stopping.py
        try:
            if start == 0 and self.held_out:
                logger.log(0, self._evaluate(0, logger))
            for step in range(start + 1, config.steps + 1):
                self.echo.step = step
                metrics, samples = self.step(step)
                if self.held_out and config.eval_every and step % config.eval_every == 0 and step < config.steps:
                    metrics.update(self._evaluate(step, logger))
                logger.log(step, metrics)
                if samples:
                    logger.log_samples(step, samples)
                history.append({"step": step, **metrics})
                progress.update(step, metrics)
                self.warnings.check(step, metrics, group_estimator=self.preparer.estimator_needs.groups)
                if self.alarm:  # the optimised reward against its weight-0 monitors
                    self.alarm.observe(step, metrics, self.last_batch)
                stopping = step < config.steps and stop.stop_here()
                if (config.save_every and step % config.save_every == 0) or step == config.steps or stopping:
                    save_rl_checkpoint(self, step, config_yaml)
                if stopping:
                    raise stop.stopped(step, checkpoint_root(self.out) / f"step-{step}")
            if self.held_out:
                final = self._evaluate(config.steps, logger)
                logger.log(config.steps, final)
                if history:
                    history[-1].update(final)
            finish_run(self.out, self.policy, self.tokenizer, f"posttrain rl: {self.out.name}", (write_recorded_view,))
        except BaseException as error:  # the report shows what was logged up to the failure, and why
            report_failure(self.out, f"posttrain rl: {self.out.name}", error, (write_recorded_view,))
            raise
        finally:
            stop.restore()
            self.echo.listen(None)
            progress.close()
            logger.close()
            self.source.close()
            if self.evaluation is not self.source and hasattr(self.evaluation, "close"):
                self.evaluation.close()  # an environment's evaluation episodes have their own event loop
            stop_workers(self.engine)
        return history

    def step(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """One RL step: collect a scored batch, compute advantages, update. Returns the step's
        metrics and a few sample completions."""
        t0 = time.perf_counter()
        with stage("generation", step):
            batch, metrics = self.source.next_batch(step)
        if step == 1 and self.config.preflight and self.rewards is not None:
            for note in preflight_rewards(
                self.rewards.names,
                batch.reward_components,
                batch.prompts,
                batch.completions,
                self.config.allow_constant_reward,
            ):
                self.echo(f"[preflight] {note}")
        t1 = time.perf_counter()
        with stage("log-probs", step):
            batch = self.prepare(batch, metrics)
        if hasattr(self.source, "annotate"):  # a recording: what preparation added, for posttrain view
            self.source.annotate(step, batch)
        self.last_batch = batch if self.alarm else None  # the alarm's evidence (kept only for it)
        metrics = self.ranks.reduce_metrics(metrics)  # the ranks' shares of the rollout as one step's
        t2 = time.perf_counter()
        with stage("update", step):
            metrics.update(self.update(batch, step))
        return_free_memory(self.updater.device.type)  # the update's activations, before the next rollout allocates
        t3 = time.perf_counter()
        self.source.sync_weights(step)
        t4 = time.perf_counter()
        self.step_count = step
        generated = float(batch.response_mask.sum())
        metrics.update(
            {
                "time/prepare_s": t2 - t1,
                "time/train_s": t3 - t2,
                "time/weight_sync_s": t4 - t3,
                "time/step_s": t4 - t0,
                "throughput/tokens_per_s": generated / max(t4 - t0, 1e-9),
                "lr": self.scheduler.get_last_lr()[0],
            }
        )
        return metrics, logged_samples(batch, self.config.log_samples)

    # ------------------------------------------------------------------ the step's stages
    def prepare(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch:
        return self.preparer.prepare(batch, metrics)

    def update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        return self.updater.update(batch, step)

    def sequence_logprobs(
        self, model: nn.Module, batch: RolloutBatch, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        return sequence_logprobs(model, batch, self.config, with_entropy=with_entropy)

    @property
    def rewards_weights(self) -> list[float]:
        return [reward.weight for reward in self.rewards.rewards] if self.rewards is not None else []

    @property
    def last_eval(self) -> Any:
        """The last held-out evaluation's samples: an ``EvalResult``, or episode records with env."""
        return getattr(self.evaluation, "last_result", None)

    # ------------------------------------------------------------------ evaluation, logs, checkpoints
    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the policy now: greedy completions scored by the rewards
        (``train/rl_eval.py``), or greedy episodes (``sources/environment.py``)."""
        if hasattr(self.engine, "catch_up"):  # a sharded policy's whole copy (rollout/gathered.py)
            self.engine.catch_up(self.step_count)
        return self.evaluation.evaluate(self.held_out)

    def _evaluate(self, step: int, logger: Any) -> dict[str, float]:
        """:meth:`evaluate`, its answers written to ``eval_samples.jsonl`` marked right or wrong."""
        with stage("evaluation", step):
            metrics = self.evaluate()
        logger.log_eval_samples(step, held_out_records(self.last_eval))
        return metrics


def run_rl(
    config: RLRun,
    *,
    reward_functions: Sequence[Callable[..., Any]] | None = None,
    echo: Echo = print,
) -> list[dict[str, float]]:
    """``posttrain rl``: build everything the config names and train; returns per-step metrics."""
    return OnlineRL(config, reward_functions=reward_functions, echo=echo).run()
