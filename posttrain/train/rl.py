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
(:class:`~posttrain.train.rl_batch.RolloutBatch`), so each can move to another process later.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLControllerHorizon,
    AdaptiveKLControllerPPO,
    FixedKLController,
    RunningMeanBaseline,
    actor_loss,
    kl_estimate,
    masked_mean,
    place_scores_at_last_token,
    shape_token_rewards,
    value_loss,
)
from posttrain.algos.mismatch import rollout_mismatch, truncated_is_weights
from posttrain.algos.registry import EstimatorNeeds
from posttrain.config import ConfigError, dump_config
from posttrain.data import DataError
from posttrain.data.lengths import context_limit
from posttrain.data.section import check_enough_rows, load_rows
from posttrain.errors import TrainingDiverged
from posttrain.memory import return_free_memory
from posttrain.models.logprobs import response_logprobs, shared_prompt_logprobs
from posttrain.models.section import build_model_and_tokenizer, check_model_source
from posttrain.rewards import NamedReward, RewardFunctionError, RewardSet, resolve_reward
from posttrain.rollout.engine import build_engine
from posttrain.sources import RolloutSource
from posttrain.sources.recorded import RecordingSource, ReplaySource, check_replay_folder
from posttrain.sources.single_turn import SingleTurnSource
from posttrain.telemetry import MetricsLogger, Progress, write_failure_report, write_report
from posttrain.telemetry.metrics import check_report_to
from posttrain.train.checkpoint import (
    load_training_state,
    load_weights_into,
    quiet_progress_bars,
    save_checkpoint,
    save_final,
)
from posttrain.train.rl_batch import RolloutBatch
from posttrain.train.rl_checks import StepWarnings, preflight_rewards
from posttrain.train.rl_config import RLRun
from posttrain.train.run_dir import prepare_run_dir, start_point
from posttrain.train.schedule import lr_multiplier

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
        self.config, self.algo, self.echo = config, config.algorithm, echo
        # everything a user can get wrong is checked before the policy loads: the run folder and
        # resume point (run_dir.py), the model folder, the data, the reward functions
        start_point(config.output_dir, config.resume, config.overwrite, dump_config(config))
        check_report_to(config.report_to)
        if model is None:
            check_model_source(config.model)
        if config.rollout.replay is not None:
            check_replay_folder(config.rollout.replay, config.steps)
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)

        # data: rows with a prompt; any other column reaches the reward functions
        task_reward = None
        if train_rows is None:
            train_rows, held, task_reward = load_rows(config.data, config.seed)
            held_out_rows = held if held_out_rows is None else held_out_rows
        self.rows = list(train_rows)
        check_enough_rows(self.rows, config.prompts_per_step, "prompts_per_step", config.data)
        self.held_out = list(held_out_rows or [])[: config.eval_size]
        self.prompt_column = config.data.prompt_column
        missing = [i for i, row in enumerate(self.rows) if self.prompt_column not in row]
        if missing:
            raise DataError(f"data row {missing[0]} has no {self.prompt_column!r} column (data.prompt_column)")
        self.rewards = RewardSet(
            self._resolve_rewards(reward_functions, task_reward),
            workers=config.reward_workers,
            timeout_s=config.reward_timeout,
            max_failed_fraction=config.reward_max_failed_fraction,
        )

        torch.manual_seed(config.seed)  # the policy's initial weights do not depend on the rewards built
        if model is None:
            model, tokenizer = build_model_and_tokenizer(config.model, config.seed)
        self.policy, self.tokenizer = model, tokenizer
        self.policy.train()
        self.out = Path(config.output_dir)

        # models around the policy
        self.reference = self._build_reference() if self.algo.kl.needs_reference else None
        self.critic = self._build_critic() if self.algo.critic is not None else None
        self.engine = build_engine(self.policy, tokenizer, kind=config.engine_kind, vllm_options=config.rollout.vllm)
        self.source = self._build_source(train_rows)

        # optimisation state
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.params = params
        # zero gradients from the start, not None: AdamW skips a parameter whose gradient is
        # None, so a step that trains no sample (every advantage 0) would move the weights
        # (momentum, weight decay) after an earlier update in this process but not right after
        # a resume in a fresh one, and the resumed run would drift from the straight one
        for param in params:
            param.grad = torch.zeros_like(param)
        self.optimizer = torch.optim.AdamW(
            params, lr=config.learning_rate, betas=config.adam_betas, weight_decay=config.weight_decay
        )
        updates_per_step = config.ppo_epochs * (config.rollout_batch_size // self.minibatch_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_multiplier(config.lr_scheduler, config.warmup_steps, config.steps * updates_per_step),
        )
        self.critic_optimizer = (
            torch.optim.AdamW(self.critic.parameters(), lr=self.algo.critic.learning_rate, betas=config.adam_betas)
            if self.critic is not None
            else None
        )
        self.kl_controller = self._build_kl_controller()
        self.running_baseline = RunningMeanBaseline() if self.algo.baseline == "running_mean" else None
        self.step_count = 0
        self.warnings = StepWarnings(echo, max_new_tokens=config.max_new_tokens)

    # ------------------------------------------------------------------ construction
    def _build_source(self, rows: Sequence[dict[str, Any]]) -> RolloutSource:
        """Where the batches come from: the engine and rewards (single turn), or a recording."""
        config = self.config
        if config.rollout.replay is not None:
            source: RolloutSource = ReplaySource(config.rollout.replay)
        else:
            limit = context_limit(self.policy)
            source = SingleTurnSource(config, self.engine, self.tokenizer, rows, self.rewards, limit, self.echo)
        if config.record_rollouts:
            source = RecordingSource(source, self.out / "rollouts")
        return source

    def _resolve_rewards(
        self, functions: Sequence[Callable[..., Any] | NamedReward] | None, task_reward: str | None
    ) -> list[NamedReward]:
        config = self.config
        specs: list[Any] = list(functions) if functions is not None else list(config.rewards)
        if not specs:
            if task_reward is None:
                raise ConfigError(
                    "no reward functions: the rows of data.path have no built-in reward; set rewards "
                    "(built-in names or pkg.module:fn paths)"
                )
            specs = [task_reward]
        weights = config.reward_weights or [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ConfigError(f"reward_weights has {len(weights)} entries for {len(specs)} reward functions")
        rewards = [
            spec if isinstance(spec, NamedReward) else resolve_reward(spec, weight)
            for spec, weight in zip(specs, weights, strict=True)
        ]
        names = [reward.name for reward in rewards]
        unknown = [name for name in config.allow_constant_reward if name not in names]
        if unknown:
            raise ConfigError(f"allow_constant_reward names {unknown}, which are not rewards of this run: {names}")
        return rewards

    def _build_reference(self) -> nn.Module | None:
        """The KL anchor: the initial policy. With LoRA it is the same model with adapters
        off (no copy); otherwise a frozen copy made before any update (and before a resume
        loads trained weights)."""
        if self.config.model.lora is not None:
            return None
        reference = copy.deepcopy(self.policy).eval()
        reference.requires_grad_(False)
        return reference

    def _build_critic(self) -> nn.Module:
        from posttrain.models.value import value_model_from_policy

        critic = value_model_from_policy(self.policy)
        critic.train()
        return critic

    def _build_kl_controller(self) -> Any:
        kl = self.algo.kl
        if kl.controller == "adaptive":
            return AdaptiveKLControllerHorizon(value=kl.coef, target=kl.target, horizon=kl.horizon)
        if kl.controller == "adaptive_ppo":
            return AdaptiveKLControllerPPO(value=kl.coef, target=kl.target)
        return FixedKLController(kl.coef)

    @property
    def minibatch_size(self) -> int:
        return self.config.minibatch_size or self.config.rollout_batch_size

    @property
    def recompute_old_logprobs(self) -> bool:
        """Only with more than one optimizer step per batch do π_old and π differ; on-policy
        the ratio is exactly 1 and π_old is π detached (TRL does the same)."""
        return self.config.ppo_epochs > 1 or self.minibatch_size < self.config.rollout_batch_size

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict[str, float]]:
        """Train for ``config.steps`` steps (resuming if asked); returns per-step metrics."""
        config = self.config
        config_yaml = dump_config(config)
        start = self._maybe_resume(prepare_run_dir(self.out, config.resume, config.overwrite, config_yaml, self.echo))
        history: list[dict[str, float]] = []
        logger = MetricsLogger(
            self.out,
            resume_step=start if start else None,
            tensorboard="tensorboard" in config.report_to,
            wandb="wandb" in config.report_to,
            run_name=config.run_name,
            config=config.model_dump(mode="json"),
        )
        progress = Progress(config.steps, keys=PROGRESS_KEYS, every=config.log_every, label="rl", start=start)
        self.source.start()  # worker start-up is not charged to the first step's reward time
        try:
            if start == 0 and self.held_out:
                logger.log(0, self.evaluate())
            for step in range(start + 1, config.steps + 1):
                metrics, samples = self.step(step)
                if self.held_out and config.eval_every and step % config.eval_every == 0 and step < config.steps:
                    metrics.update(self.evaluate())
                logger.log(step, metrics)
                if samples:
                    logger.log_samples(step, samples)
                history.append({"step": step, **metrics})
                progress.update(step, metrics)
                self.warnings.check(step, metrics, group_estimator=self.estimator_needs.groups)
                if (config.save_every and step % config.save_every == 0) or step == config.steps:
                    self.save(step, config_yaml)
            if self.held_out:
                final = self.evaluate()
                logger.log(config.steps, final)
                if history:
                    history[-1].update(final)
            with quiet_progress_bars():
                save_final(self.policy, self.out / "final", self.tokenizer)
            write_report(self.out, title=f"posttrain rl: {self.out.name}")
        except BaseException as error:  # the report shows what was logged up to the failure, and why
            write_failure_report(self.out, title=f"posttrain rl: {self.out.name}", error=error)
            raise
        finally:
            progress.close()
            logger.close()
            self.source.close()
        return history

    def step(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """One RL step: collect a scored batch, compute advantages, update. Returns the step's
        metrics and a few sample completions."""
        t0 = time.perf_counter()
        batch, metrics = self.source.next_batch(step)
        if step == 1 and self.config.preflight:
            for note in preflight_rewards(
                self.rewards.names,
                batch.reward_components,
                batch.prompts,
                batch.completions,
                self.config.allow_constant_reward,
            ):
                self.echo(f"[preflight] {note}")
        t1 = time.perf_counter()
        batch = self.prepare(batch, metrics)
        t2 = time.perf_counter()
        metrics.update(self.update(batch, step))
        return_free_memory()  # the update's activations, before the next rollout or evaluation allocates
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
        return metrics, self._samples(batch)

    # ------------------------------------------------------------------ advantages
    @torch.no_grad()
    def prepare(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch:
        """Drop unscored samples (and, for ReMax, prompts whose greedy decode got no reward);
        add π_old, π_ref, values, token rewards and advantages."""
        algo = self.algo
        scored = ~batch.scores.isnan()
        if not bool(scored.all()):
            metrics["reward/unscored_dropped"] = float((~scored).sum())
            batch = batch.select(torch.nonzero(scored).flatten())
        baseline = self._baseline(batch) if len(batch) else None
        if baseline is not None and bool(baseline.isnan().any()):
            # no baseline is no advantage: A = r − 0 would be a made-up signal for the whole prompt
            has_baseline = ~baseline.isnan()
            metrics["reward/baseline_missing_dropped"] = float((~has_baseline).sum())
            batch, baseline = batch.select(torch.nonzero(has_baseline).flatten()), baseline[has_baseline]
        if len(batch) == 0:
            raise RewardFunctionError(
                "no sample of this batch has a reward (every one is None, NaN, timed out or lacks its greedy "
                "baseline); see the reward/*/none_fraction and reward/*/failed_fraction metrics"
            )
        loss_mask = batch.response_mask.clone()
        if algo.mask_truncated:
            loss_mask[batch.truncated] = 0.0
        batch.loss_mask = loss_mask
        if self.recompute_old_logprobs:
            batch.old_logprobs = self._logprobs(self.policy, batch)
            # the engine's log-probs are their own stream: how far from the trainer's π_old (on-policy
            # runs measure it in the update's own forward instead, over the samples it trains on)
            metrics.update(
                rollout_mismatch(
                    batch.old_logprobs, batch.engine_logprobs, batch.response_mask, self.config.rollout.tis_cap
                )
            )
        if algo.kl.needs_reference:
            batch.ref_logprobs = self._reference_logprobs(batch)
        if self.critic is not None:
            batch.values = self._values(batch) * batch.response_mask
        rollout_logprobs = batch.old_logprobs if batch.old_logprobs is not None else batch.engine_logprobs
        if algo.kl.placement == "reward":
            beta = self.kl_controller.value
            batch.token_rewards, kl_metrics = shape_token_rewards(
                batch.scores,
                rollout_logprobs,
                batch.ref_logprobs,
                batch.response_mask,
                beta,
                kind=algo.kl.estimator,
                level=algo.kl.level,
            )
            # kl/reward is the controller's input itself (the rollout policy's KL with the run's
            # estimator, per-sequence token mean); kl/ref, logged by the update, is k3 of the
            # policy being trained, a different number, so the two keep separate names
            reward_kl = float(kl_metrics["kl"])
            metrics["kl/reward"] = reward_kl
            metrics["kl/coef"] = beta
            self.kl_controller.update(reward_kl, len(batch))
        else:
            batch.token_rewards = place_scores_at_last_token(batch.scores, batch.response_mask)
        batch.baseline_scores = baseline
        options = dict(algo.advantage_options)
        if self.estimator_needs.reward_weights and "component_weights" not in options:
            options["component_weights"] = self.rewards_weights
        # components stay NaN where a reward does not apply to a prompt: GDPO leaves them out
        components = batch.reward_components
        batch.advantages, batch.returns = ADVANTAGE_ESTIMATORS[algo.advantage](
            token_rewards=batch.token_rewards,
            response_mask=batch.response_mask,
            group_ids=batch.group_ids,
            values=batch.values,
            baseline_scores=batch.baseline_scores,
            reward_components=components,
            **options,
        )
        valid = batch.response_mask.bool()
        adv = batch.advantages[valid]
        if not bool(torch.isfinite(adv).all()):
            # a NaN advantage would only make its samples look inactive and skip them in silence
            raise TrainingDiverged(
                f"{int((~torch.isfinite(adv)).sum())} advantages of this batch are not finite (rewards from "
                f"{float(batch.scores.min()):g} to {float(batch.scores.max()):g}); check the scale of the rewards"
                + (" and the critic's values" if batch.values is not None else "")
            )
        if adv.numel():
            metrics.update(
                {
                    "advantage/mean": float(adv.mean()),
                    "advantage/std": float(adv.std(unbiased=False)),
                    "advantage/abs_max": float(adv.abs().max()),
                }
            )
        return batch

    @property
    def estimator_needs(self) -> EstimatorNeeds:
        """What the run's advantage estimator declared it needs (algos/registry.py)."""
        return ADVANTAGE_ESTIMATORS.needs[self.algo.advantage]

    @property
    def rewards_weights(self) -> list[float]:
        return [reward.weight for reward in self.rewards.rewards]

    def _baseline(self, batch: RolloutBatch) -> Tensor | None:
        if self.algo.baseline == "running_mean":
            value = self.running_baseline.value
            self.running_baseline.update(batch.scores)
            return torch.full_like(batch.scores, value)
        return batch.baseline_scores  # ReMax's greedy decode, scored by the source; None otherwise

    def sequence_logprobs(
        self, model: nn.Module, batch: RolloutBatch, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, T]`` log-probs (and entropies) of ``batch``'s responses under ``model`` at the
        sampling temperature; prompts shared by a group are encoded once when configured."""
        temperature = self.config.temperature_value
        if self.config.shared_prompt_forward:
            groups, prompt_index = torch.unique(batch.group_ids, return_inverse=True)
            first = torch.full((groups.numel(),), len(batch), dtype=torch.long)
            first = first.scatter_reduce(0, prompt_index, torch.arange(len(batch)), "amin")
            return shared_prompt_logprobs(
                model,
                batch.prompt_ids[first],
                batch.prompt_mask[first],
                batch.response_ids,
                batch.response_mask,
                prompt_index,
                temperature=temperature,
                with_entropy=with_entropy,
            )
        return response_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            response_mask=batch.response_mask,
            temperature=temperature,
            with_entropy=with_entropy,
        )

    def _logprobs(self, model: nn.Module, batch: RolloutBatch) -> Tensor:
        size = self.config.micro_batch_size or len(batch)
        parts = [
            self.sequence_logprobs(model, batch.select(torch.arange(start, min(start + size, len(batch)))))[0]
            for start in range(0, len(batch), size)
        ]
        return torch.cat(parts)

    def _values(self, batch: RolloutBatch) -> Tensor:
        """``[B, T]`` critic values of the batch, ``micro_batch_size`` samples per forward pass."""
        from posttrain.models.value import response_values

        size = self.config.micro_batch_size or len(batch)
        parts = []
        for start in range(0, len(batch), size):
            chunk = batch.select(torch.arange(start, min(start + size, len(batch))))
            parts.append(response_values(self.critic, chunk.input_ids, chunk.attention_mask, chunk.prompt_ids.shape[1]))
        return torch.cat(parts)

    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        if self.reference is not None:
            return self._logprobs(self.reference, batch)
        from posttrain.models.lora import reference_policy

        with reference_policy(self.policy):
            return self._logprobs(self.policy, batch)

    # ------------------------------------------------------------------ update
    def update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of minibatch updates over the batch; returns averaged metrics."""
        config = self.config
        groups = batch.group_ids.unique()
        groups_per_minibatch = max(1, self.minibatch_size // config.samples_per_prompt)
        generator = torch.Generator().manual_seed(config.seed * 7919 + step)
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(config.ppo_epochs):
            order = (
                groups[torch.randperm(groups.numel(), generator=generator)] if self.recompute_old_logprobs else groups
            )
            for start in range(0, order.numel(), groups_per_minibatch):
                members = torch.isin(batch.group_ids, order[start : start + groups_per_minibatch])
                minibatch = batch.select(torch.nonzero(members).flatten())
                for key, value in self._minibatch_update(minibatch, step).items():
                    sums[key] = max(sums.get(key, value), value) if key.endswith("_max") else sums.get(key, 0.0) + value
                updates += 1
        metrics = {key: value if key.endswith("_max") else value / max(updates, 1) for key, value in sums.items()}
        metrics["train/updates"] = float(updates)
        return metrics

    def _minibatch_update(self, minibatch: RolloutBatch, step: int) -> dict[str, float]:
        config, algo = self.config, self.algo
        loss_mask = minibatch.loss_mask
        num_tokens = loss_mask.sum()
        num_seqs = (loss_mask.sum(-1) > 0).sum()
        aggregation = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_constant": float(config.max_new_tokens)}
        loss_fn = POLICY_LOSSES[algo.policy_loss]
        beta = self.kl_controller.value if algo.kl.placement == "loss" else 0.0
        # zeroed rather than freed: a minibatch whose samples are all skipped still takes the
        # optimizer step the full computation would take (zero gradient, Adam moments decaying)
        self.optimizer.zero_grad(set_to_none=False)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        trained = self._samples_with_gradient(minibatch)
        trained_tokens = max(float(trained.loss_mask.sum()), 1.0)
        size = config.micro_batch_size or len(minibatch)
        sums: dict[str, float] = {
            "train/active_fraction": len(trained) / max(len(minibatch), 1),
            "loss/total": 0.0,
            "loss/policy": 0.0,
        }
        for start in range(0, len(trained), size):
            micro = trained.select(torch.arange(start, min(start + size, len(trained)))).trimmed()
            share = float(micro.loss_mask.sum()) / trained_tokens
            logprobs, entropy = self.sequence_logprobs(self.policy, micro, with_entropy=True)
            old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
            options = dict(algo.loss_options)
            if config.rollout.tis_cap is not None:  # π_old/π_rollout: the engine sampled, not π_old
                options["weights"] = truncated_is_weights(old, micro.engine_logprobs, config.rollout.tis_cap)
            policy_loss, loss_metrics = loss_fn(
                logprobs=logprobs,
                old_logprobs=old,
                advantages=micro.advantages,
                response_mask=micro.loss_mask,
                agg_mode=algo.agg_mode,
                **aggregation,
                **options,
            )
            kl = None
            if micro.ref_logprobs is not None and algo.kl.placement == "loss":
                kl = kl_estimate(logprobs, micro.ref_logprobs, algo.kl.estimator, response_mask=micro.loss_mask)
            total, actor_metrics = actor_loss(
                policy_loss,
                micro.loss_mask,
                entropy=entropy if algo.entropy_coef else entropy.detach(),
                entropy_coef=algo.entropy_coef,
                kl=kl,
                kl_coef=beta,
                agg_mode=algo.agg_mode,
                **aggregation,
            )
            if not torch.isfinite(total):
                raise TrainingDiverged(
                    f"step {step}: the RL loss is {float(total)}; the last complete checkpoint is kept. Lower "
                    f"learning_rate (now {config.learning_rate:g}) or check the rewards of this batch."
                )
            total.backward()
            with torch.no_grad():
                micro_metrics = {
                    "loss/total": float(total),
                    "loss/policy": float(actor_metrics["policy"]),
                    "policy/entropy": float(actor_metrics["entropy"]),
                    **{f"policy/{k}": float(v) for k, v in loss_metrics.items()},
                }
                if "kl" in actor_metrics:
                    micro_metrics["loss/kl"] = float(actor_metrics["kl"])
                if micro.ref_logprobs is not None:
                    micro_metrics["kl/ref"] = float(
                        masked_mean(kl_estimate(logprobs, micro.ref_logprobs, "k3"), micro.response_mask)
                    )
                micro_metrics["policy/engine_logprob_gap"] = float(
                    masked_mean((old - micro.engine_logprobs).abs(), micro.response_mask)
                )
                if micro.old_logprobs is None:  # on-policy: this forward is π_old, no extra pass needed
                    micro_metrics.update(
                        rollout_mismatch(old, micro.engine_logprobs, micro.response_mask, config.rollout.tis_cap)
                    )
            if self.critic is not None:
                micro_metrics.update(self._critic_loss(micro, share))
            for key, value in micro_metrics.items():
                if key.endswith("_max"):  # a maximum over micro-batches, not a mean
                    sums[key] = max(sums.get(key, value), value)
                    continue
                # sums-of-means in proportion to each micro-batch's tokens: the minibatch mean
                weight = 1.0 if key in ("loss/total", "loss/policy", "loss/kl") else share
                sums[key] = sums.get(key, 0.0) + value * weight
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm or math.inf))
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(f"step {step}: the policy gradient norm is {grad_norm}; lower learning_rate")
        self.optimizer.step()
        self.scheduler.step()
        if self.critic_optimizer is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), config.max_grad_norm or math.inf)
            self.critic_optimizer.step()
        sums["policy/grad_norm"] = grad_norm
        return sums

    def _samples_with_gradient(self, minibatch: RolloutBatch) -> RolloutBatch:
        """The samples whose loss can have a gradient.

        Without an entropy bonus, a KL term in the loss or a critic, a sample whose advantages
        are all 0 (e.g. every sample of its group got the same reward) contributes exactly 0 to
        every registered policy loss, so its forward and backward passes are skipped. The loss
        is still normalised over the whole minibatch (``num_tokens``/``num_seqs``), so the
        gradient is the same as computing it; only time is saved (most groups, once a task is
        mostly solved). Diagnostics such as entropy and clip fraction then cover the trained
        samples.
        """
        algo = self.algo
        if algo.entropy_coef or algo.kl.placement == "loss" or self.critic is not None:
            return minibatch
        active = (minibatch.advantages.abs() * minibatch.loss_mask).sum(-1) > 0
        if bool(active.all()):
            return minibatch
        return minibatch.select(torch.nonzero(active).flatten())

    def _critic_loss(self, micro: RolloutBatch, share: float) -> dict[str, float]:
        from posttrain.models.value import response_values

        critic_cfg = self.algo.critic
        values = response_values(self.critic, micro.input_ids, micro.attention_mask, micro.prompt_ids.shape[1])
        loss, metrics = value_loss(
            values, micro.values, micro.returns, micro.loss_mask, clip_range=critic_cfg.value_clip
        )
        (loss * share).backward()  # no loss_coef: AdamW would cancel it (CriticSection)
        return {
            "loss/value": float(loss.detach()),
            "critic/clip_fraction": float(metrics["clip_fraction"]),
            "critic/explained_variance": float(metrics["explained_variance"]),
        }

    # ------------------------------------------------------------------ evaluation, logs, checkpoints
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts, ended by the same stop strings as the
        samples, scored by the run's rewards."""
        from posttrain.evaluate import evaluate

        components: list[Tensor] = []

        def score(prompts: list[Any], completions: list[str], completion_ids: list[list[int]], **columns: Any) -> list:
            result = self.rewards.score(prompts, completions, completion_ids, columns)
            components.append(result.components)
            return [None if math.isnan(v) else v for v in result.scores.tolist()]

        config = self.config
        result = evaluate(
            self.policy,
            self.tokenizer,
            self.held_out,
            score,
            max_new_tokens=config.max_new_tokens,
            batch_size=config.eval_batch_size,
            stop=config.sampling.stop,
        )
        self.policy.train()
        values = [s["reward"] for s in result.samples if s["reward"] is not None]
        metrics = {"eval/reward": result.accuracy}
        if len(self.rewards.names) > 1:  # each function's own mean, weight-0 (monitoring) ones included
            table = torch.cat(components)
            for index, name in enumerate(self.rewards.names):
                metrics[f"eval/{name}/mean"] = float(table[:, index].nanmean())
                # full marks: a task scorer's partial credit (reasoning-gym gives 0.01 for a
                # wrong number) would otherwise read as accuracy in the mean
                metrics[f"eval/{name}/solved"] = float((table[:, index] >= 1.0).float().mean())
        if len(self.rewards.names) == 1 and values and all(v in (0.0, 1.0) for v in values):
            metrics["eval/accuracy"] = result.accuracy
        self.last_eval = result
        return metrics

    def _samples(self, batch: RolloutBatch) -> list[dict[str, Any]]:
        count = min(self.config.log_samples, len(batch))
        return [
            {
                "prompt": batch.prompts[i] if isinstance(batch.prompts[i], str) else str(batch.prompts[i]),
                "completion": batch.completions[i],
                "reward": None if math.isnan(float(batch.scores[i])) else float(batch.scores[i]),
                "advantage": float(batch.advantages[i][batch.response_mask[i].bool()][:1].sum()),
            }
            for i in range(count)
        ]

    def save(self, step: int, config_yaml: str | None = None) -> None:
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kl_coef": self.kl_controller.value,
            **self.source.state_dict(),
        }
        if self.running_baseline is not None:
            state["running_baseline"] = self.running_baseline.state_dict()
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
        save_checkpoint(
            self.out,
            step,
            model=self.policy,
            tokenizer=self.tokenizer,
            config_yaml=config_yaml,
            keep_last=self.config.keep_last,
            training_state=state,
        )

    def _maybe_resume(self, path: Path | None) -> int:
        """Restore everything from checkpoint ``path``; return its step (0 for a fresh start)."""
        if path is None:
            return 0
        load_weights_into(self.policy, path)
        state = load_training_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_controller.value = float(state["kl_coef"])
        if self.running_baseline is not None:
            self.running_baseline.load_state_dict(state["running_baseline"])
        for name in self.source.load_state_dict(state):
            self.echo(
                f"[resume] {path} holds no state for {name} (saved by an older posttrain): its "
                "running statistics start again, so rewards after the resume differ from a straight run"
            )
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.source.sync_weights(int(state["step"]))
        self.echo(f"[resume] step {state['step']} restored from {path}")
        return int(state["step"])


def run_rl(
    config: RLRun,
    *,
    reward_functions: Sequence[Callable[..., Any]] | None = None,
    echo: Echo = print,
) -> list[dict[str, float]]:
    """``posttrain rl``: build everything the config names and train; returns per-step metrics."""
    return OnlineRL(config, reward_functions=reward_functions, echo=echo).run()
