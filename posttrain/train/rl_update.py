"""The update, the RL step's last stage: ``ppo_epochs`` passes of minibatch steps over a
prepared batch — micro-batches accumulated, the policy loss of the run's registry entry with
truncated importance weights, KL and entropy terms, the critic's value loss, gradient clipping —
and the step's averaged metrics (docs/algorithms.md §4).

Under torchrun every rank holds the step's whole prepared batch and walks the same minibatches;
each runs the forward and backward passes of its share of a minibatch's groups, with the loss
normalised by the whole minibatch, and the ranks sum their gradients before the clip and the
identical optimizer steps (distributed.py) — the one-process update, computed in parts."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import (
    POLICY_LOSSES,
    actor_loss,
    kl_estimate,
    loglinear_proximal_logprobs,
    masked_mean,
    value_loss,
)
from posttrain.algos.mismatch import rollout_mismatch, truncated_is_weights
from posttrain.algos.value import EXPLAINED_VARIANCE_PARTS, explained_variance_of, explained_variance_parts
from posttrain.devices import compute_precision, model_device
from posttrain.distributed import is_sharded, world
from posttrain.errors import TrainingDiverged
from posttrain.rollout.batch import RolloutBatch
from posttrain.train.micro_batches import micro_batch_bounds
from posttrain.train.rl_config import RLRun
from posttrain.train.rl_prepare import sequence_logprobs
from posttrain.train.schedule import lr_multiplier

# metrics a micro-batch reports as its part of the minibatch's value (summed, not weighted)
MINIBATCH_PARTS = ("loss/total", "loss/policy", "loss/kl", "policy/entropy")


class PolicyUpdate:
    """Holds the optimisation state (policy and critic optimizers, the schedule) and applies
    one step's update."""

    def __init__(self, config: RLRun, policy: nn.Module, critic: nn.Module | None, kl_controller: Any) -> None:
        self.config, self.algo = config, config.algorithm
        self.policy, self.critic, self.kl_controller = policy, critic, kl_controller
        self.device = model_device(policy)
        self.minibatch_size = config.minibatch_samples
        self.several_updates = config.several_updates
        # AReaL's decoupled objective (a loss that takes proximal_logprobs): π_prox is the policy
        # at the start of this step, π_behav the engine that sampled the tokens
        self.decoupled = POLICY_LOSSES.declares(config.algorithm.policy_loss, "proximal_logprobs")
        self.anchors_on_engine = config.anchors_on_engine
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.ranks, self.sharded = world(), is_sharded(policy)
        # zero gradients from the start, not None: AdamW skips a parameter whose gradient is
        # None, so a step that trains no sample (every advantage 0) would move the weights
        # (momentum, weight decay) after an earlier update in this process but not right after
        # a resume in a fresh one, and the resumed run would drift from the straight one
        for param in self.params:
            param.grad = torch.zeros_like(param)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.learning_rate, betas=config.adam_betas, weight_decay=config.weight_decay
        )
        updates = config.steps * config.ppo_epochs * (config.rollout_batch_size // self.minibatch_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_multiplier(config.lr_scheduler, config.warmup_steps, updates, config.min_lr_ratio)
        )
        # what of the critic trains: all of it, or a LoRA critic's adapters and head
        self.critic_params = [p for p in critic.parameters() if p.requires_grad] if critic is not None else []
        self.critic_optimizer = (
            torch.optim.AdamW(self.critic_params, lr=self.algo.critic.learning_rate, betas=config.adam_betas)
            if critic is not None
            else None
        )

    def sequence_logprobs(self, model: nn.Module, batch: RolloutBatch, *, with_entropy: bool = False) -> Any:
        return sequence_logprobs(model, batch, self.config, with_entropy=with_entropy)

    def update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of minibatch updates over the batch; returns averaged metrics."""
        config = self.config
        groups = batch.group_ids.unique()
        groups_per_minibatch = max(1, self.minibatch_size // config.samples_per_prompt)
        generator = torch.Generator().manual_seed(config.seed * 7919 + step)
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(config.ppo_epochs):
            order = groups[torch.randperm(groups.numel(), generator=generator)] if self.several_updates else groups
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
        """One optimizer step on a minibatch: its micro-batches' gradients accumulated, each
        weighted by its share of the minibatch's loss tokens; returns the minibatch's metrics."""
        loss_mask = minibatch.loss_mask
        aggregation = {
            "num_tokens": loss_mask.sum(),
            "num_seqs": (loss_mask.sum(-1) > 0).sum(),
            "norm_constant": float(self.config.max_new_tokens),
        }
        # zeroed rather than freed: a minibatch whose samples are all skipped still takes the
        # optimizer step the full computation would take (zero gradient, Adam moments decaying)
        self.optimizer.zero_grad(set_to_none=False)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        trained = self._samples_with_gradient(minibatch)
        trained_tokens = max(float(trained.loss_mask.sum()), 1.0)
        active_fraction = len(trained) / max(len(minibatch), 1)
        trained = self._share(trained, minibatch)
        sums: dict[str, float] = {"loss/total": 0.0, "loss/policy": 0.0}
        config = self.config
        bounds = micro_batch_bounds(
            *trained.lengths(), config.micro_batch_size, config.micro_batch_tokens, packed=config.padding_free
        )
        for index in range(self.ranks.most(len(bounds)) if self.sharded else len(bounds)):
            if index >= len(bounds):  # a sharded model's passes are collectives: join with a zero-weight one
                self._zero_pass(minibatch.select([0]).trimmed().to(self.device), aggregation, step)
                continue
            # on the policy's device: its forward, the loss and the backward pass run there (devices.py)
            micro = trained.select(torch.arange(*bounds[index])).trimmed().to(self.device)
            share = float(micro.loss_mask.sum()) / trained_tokens
            micro_metrics = self._micro_backward(micro, aggregation, step)
            if self.critic is not None:
                micro_metrics.update(self._critic_loss(micro, share))
            for key, value in micro_metrics.items():
                if key.endswith("_max"):  # a maximum over micro-batches, not a mean
                    sums[key] = max(sums.get(key, value), value)
                    continue
                # sums-of-means in proportion to each micro-batch's tokens: the minibatch mean (the
                # loss terms are already parts of it: aggregated with the minibatch's normaliser)
                weight = 1.0 if key in MINIBATCH_PARTS or key.startswith("critic/explained_variance/") else share
                sums[key] = sums.get(key, 0.0) + value * weight
        sums = self.ranks.reduce_metrics(sums, summed=True)  # each rank's sums are parts of the minibatch's
        parts = {name: sums.pop(f"critic/explained_variance/{name}") for name in EXPLAINED_VARIANCE_PARTS
                 if f"critic/explained_variance/{name}" in sums}  # fmt: skip
        if parts:
            sums["critic/explained_variance"] = explained_variance_of(parts)
        sums["train/active_fraction"] = active_fraction
        sums["policy/grad_norm"] = self._optimizer_step(step)
        return sums

    def _zero_pass(self, micro: RolloutBatch, aggregation: dict[str, Any], step: int) -> None:
        """A forward and backward pass that adds nothing to the gradients (weight 0): what a rank
        with no samples left runs while the others train, when every pass is a collective."""
        self._micro_backward(micro, aggregation, step, weight=0.0)
        if self.critic is not None:
            self._critic_loss(micro, 0.0)

    def _share(self, trained: RolloutBatch, minibatch: RolloutBatch) -> RolloutBatch:
        """This rank's part of the samples to train: those of its share of the minibatch's groups
        (an uneven share is fine: the loss is normalised by the whole minibatch)."""
        if self.ranks.size == 1:  # every sample: no copy of the minibatch on the update's hot path
            return trained
        mine = torch.tensor(self.ranks.split(minibatch.group_ids.unique().tolist()), dtype=torch.long)
        return trained.select(torch.nonzero(torch.isin(trained.group_ids, mine)).flatten())

    def _micro_backward(
        self, micro: RolloutBatch, aggregation: dict[str, Any], step: int, weight: float = 1.0
    ) -> dict[str, float]:
        """The actor loss of one micro-batch (policy loss, KL, entropy), backpropagated; its metrics."""
        config, algo = self.config, self.algo
        logprobs, entropy = self.sequence_logprobs(self.policy, micro, with_entropy=True)
        old, anchors = self._ratio_anchors(micro, logprobs.detach(), step)
        policy_loss, loss_metrics = POLICY_LOSSES[algo.policy_loss](
            logprobs=logprobs,
            advantages=micro.advantages,
            response_mask=micro.loss_mask,
            agg_mode=algo.agg_mode,
            **aggregation,
            **{**algo.loss_options, **anchors},
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
            kl_coef=self.kl_controller.value if algo.kl.placement == "loss" else 0.0,
            agg_mode=algo.agg_mode,
            **aggregation,
        )
        if not torch.isfinite(total):
            raise TrainingDiverged(
                f"step {step}: the RL loss is {float(total)}; the last complete checkpoint is kept. Lower "
                f"learning_rate (now {config.learning_rate:g}) or check the rewards of this batch."
            )
        (total * weight).backward()
        with torch.no_grad():
            metrics = {
                "loss/total": float(total),
                "loss/policy": float(actor_metrics["policy"]),
                "policy/entropy": float(actor_metrics["entropy"]),
                **{f"policy/{k}": float(v) for k, v in loss_metrics.items()},
            }
            if "kl" in actor_metrics:
                metrics["loss/kl"] = float(actor_metrics["kl"])
            if micro.ref_logprobs is not None:
                metrics["kl/ref"] = float(
                    masked_mean(kl_estimate(logprobs, micro.ref_logprobs, "k3"), micro.response_mask)
                )
            metrics["policy/engine_logprob_gap"] = float(
                masked_mean((old - micro.engine_logprobs).abs(), micro.response_mask)
            )
            if micro.old_logprobs is None or self.anchors_on_engine:
                # on-policy this forward is π_old, no extra pass needed; async it is the trainer
                # against the (older) weights that sampled
                metrics.update(
                    rollout_mismatch(
                        logprobs.detach(), micro.engine_logprobs, micro.response_mask, config.rollout.tis_cap
                    )
                )
        return metrics

    def _ratio_anchors(self, micro: RolloutBatch, current: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """(π_old, the policy loss's log-prob arguments): ``old_logprobs`` (and, for the decoupled
        loss, ``proximal_logprobs``, with old_logprobs then the engine's, π_behav) and the
        truncated importance weights of ``rollout.tis_cap``. ``current``: this forward, detached."""
        old = micro.old_logprobs if micro.old_logprobs is not None else current
        anchors: dict[str, Tensor] = {"old_logprobs": old}
        if self.config.rollout.tis_cap is not None:  # π_old/π_engine: the engine sampled, not π_old
            anchors["weights"] = truncated_is_weights(old, micro.engine_logprobs, self.config.rollout.tis_cap)
        if self.decoupled:
            if self.algo.proximal == "loglinear":  # AReaL's approximation, no forward pass
                versions = micro.policy_version if micro.token_versions is None else micro.token_versions
                old = loglinear_proximal_logprobs(micro.engine_logprobs, current, versions, step - 1)
            anchors.update(old_logprobs=micro.engine_logprobs, proximal_logprobs=old)
        return old, anchors

    def _optimizer_step(self, step: int) -> float:
        """Clip, step the policy (and critic) optimizers and the schedule; the policy's gradient norm."""
        max_norm = self.config.max_grad_norm or math.inf
        self.ranks.sum_gradients(self.params)  # the whole minibatch's gradient on every rank
        if self.critic is not None:
            self.ranks.sum_gradients(self.critic_params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(f"step {step}: the policy gradient norm is {grad_norm}; lower learning_rate")
        self.optimizer.step()
        self.scheduler.step()
        if self.critic_optimizer is not None:
            torch.nn.utils.clip_grad_norm_(self.critic_params, max_norm)
            self.critic_optimizer.step()
        return grad_norm

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
        from posttrain.models.adapter_critic import critic_pass
        from posttrain.models.value import response_values

        critic_cfg = self.algo.critic
        with critic_pass(self.critic):  # a light critic's adapters, also for layers recomputed in backward
            with compute_precision(self.config.precision, self.device):
                values = response_values(self.critic, micro.input_ids, micro.attention_mask, micro.prompt_ids.shape[1])
            loss, metrics = value_loss(
                values.float(), micro.values, micro.returns, micro.loss_mask, clip_range=critic_cfg.value_clip
            )
            (loss * share).backward()  # no loss_coef: AdamW would cancel it (CriticSection)
        parts = explained_variance_parts(values.float(), micro.returns, micro.loss_mask)
        return {
            "loss/value": float(loss.detach()),
            "critic/clip_fraction": float(metrics["clip_fraction"]),
            **{f"critic/explained_variance/{name}": value for name, value in parts.items()},
        }
