"""Batch preparation, the RL step's middle stage: a scored batch from the rollout source gets
what the update needs — unusable samples dropped, π_old (when the update is off-policy), π_ref,
the critic's values, token rewards (with the KL penalty where it goes in the reward) and the
advantages of the run's estimator (docs/algorithms.md §2, §3).

Under torchrun each rank scores its own share of the step's groups and runs the forward passes
(π_old, π_ref, values) for it; then the shares are gathered (small CPU tensors) and every rank
computes the rewards, the KL controller's input, the running baseline and the advantages of the
*whole* batch alike — so batch statistics (REINFORCE++'s and PPO's whitening, the adaptive KL)
are the one-process ones, and no estimator needs to know about ranks (distributed.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLControllerHorizon,
    AdaptiveKLControllerPPO,
    FixedKLController,
    place_scores_at_last_token,
    shape_token_rewards,
)
from posttrain.algos.mismatch import rollout_mismatch
from posttrain.algos.registry import EstimatorNeeds
from posttrain.devices import compute_precision, model_device
from posttrain.distributed import is_sharded, world
from posttrain.errors import TrainingDiverged
from posttrain.models.logprobs import output_layer, response_logprobs, shared_prompt_logprobs
from posttrain.models.packing import packed_logprobs
from posttrain.rewards import RewardFunctionError
from posttrain.rollout.batch import RolloutBatch, concat
from posttrain.train.micro_batches import micro_batch_bounds
from posttrain.train.rl_config import RLRun


def build_kl_controller(kl: Any) -> Any:
    """The controller of β for ``algorithm.kl`` (docs/algorithms.md §3.3): fixed or adaptive."""
    if kl.controller == "adaptive":
        return AdaptiveKLControllerHorizon(value=kl.coef, target=kl.target, horizon=kl.horizon)
    if kl.controller == "adaptive_ppo":
        return AdaptiveKLControllerPPO(value=kl.coef, target=kl.target)
    return FixedKLController(kl.coef)


def sequence_logprobs(
    model: nn.Module, batch: RolloutBatch, config: RLRun, *, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``[B, T]`` log-probs (and entropies) of ``batch``'s responses under ``model`` at the
    sampling temperature, on the model's device in the run's ``precision``; prompts shared by a
    group are encoded once when configured."""
    device = model_device(model)
    batch = batch.to(device)
    with compute_precision(config.precision, device):
        return _sequence_logprobs(model, batch, config, with_entropy)


def activation_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` recomputes activations in its backward pass. transformers 5 renamed the
    property (``is_gradient_checkpointing`` warns, deprecated): the new name is read first, also
    through a wrapper that forwards attributes (PEFT's), so no run prints a warning caused by this
    check; the old name only where the new one does not exist (transformers 4)."""
    value = getattr(model, "is_activation_checkpointing", None)
    if value is None:
        value = getattr(model, "is_gradient_checkpointing", False)
    return bool(value)


def _sequence_logprobs(
    model: nn.Module, batch: RolloutBatch, config: RLRun, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    temperature = config.temperature_value
    # the trainer's log-probs over each token's kept set, as the sampler drew it (rollout.keep_sampling_mask)
    support = batch.sampling_mask if config.rollout.keep_sampling_mask else None
    if config.padding_free:
        return packed_logprobs(
            model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            batch.response_widths(),
            temperature=temperature,
            with_entropy=with_entropy,
            support=support,
        )
    # a checkpointed model in training mode runs without a KV cache (transformers turns use_cache
    # off), so responses would not see the encoded prompt: it takes the full forward instead
    checkpointed = model.training and activation_checkpointing(model)
    if config.shared_prompt_forward and not checkpointed:
        first, prompt_index = distinct_prompts(batch.prompt_ids, batch.prompt_mask)
        return shared_prompt_logprobs(
            model,
            batch.prompt_ids[first],
            batch.prompt_mask[first],
            batch.response_ids,
            batch.response_mask,
            prompt_index,
            temperature=temperature,
            with_entropy=with_entropy,
            response_attention=batch.response_attention,
            support=support,
        )
    return response_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        response_mask=batch.response_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        lm_head_chunks=output_layer(model) is not None,  # never the [B, T, V] logits
        support=support,
    )


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each distinct left-padded prompt's first row ``[U]`` and each row's prompt ``[B]``, in order
    of first appearance. A group's samples usually share their prompt, but not always: an
    episode split where the chat template rewrote history goes on as a sample of its group whose
    prompt is the conversation so far, and an environment may draw each episode's first
    observation — so prompts are told apart by their tokens, not by their group.

    A group's samples sit next to each other, so rows are first compared with the row before
    (one vectorised comparison); only the first row of each run is looked up by its tokens on
    the host. ``torch.unique(dim=0)`` compares rows pair by pair: on 2 cores 0.46 ms for a
    256-sample batch of 32 prompts, against 0.12 ms this way."""
    rows = torch.cat([prompt_ids, prompt_mask.long()], dim=1)
    starts = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    starts[1:] = (rows[1:] != rows[:-1]).any(-1)
    run_of_row = starts.cumsum(0) - 1
    start_rows = torch.nonzero(starts).flatten()
    index: dict[tuple[int, ...], int] = {}
    first, prompt_of_run = [], []
    for row, tokens in zip(start_rows.tolist(), map(tuple, rows[start_rows].tolist()), strict=True):
        if tokens not in index:
            index[tokens] = len(first)
            first.append(row)
        prompt_of_run.append(index[tokens])
    device = prompt_ids.device
    prompt_of_row = torch.tensor(prompt_of_run, dtype=torch.long, device=device)[run_of_row]
    return torch.tensor(first, dtype=torch.long, device=device), prompt_of_row


class BatchPreparer:
    """Holds what preparation reads (the models, the KL controller, the running baseline) and
    turns a scored batch into one the update can train on."""

    def __init__(
        self,
        config: RLRun,
        policy: nn.Module,
        reference: nn.Module | None,
        critic: nn.Module | None,
        kl_controller: Any,
        running_baseline: Any,
        rewards_weights: list[float],
    ) -> None:
        self.config, self.algo = config, config.algorithm
        self.policy, self.reference, self.critic = policy, reference, critic
        self.kl_controller, self.running_baseline = kl_controller, running_baseline
        self.rewards_weights = rewards_weights
        self.recompute_old_logprobs = config.recomputes_old_logprobs
        self.ranks = world()

    @property
    def estimator_needs(self) -> EstimatorNeeds:
        """What the run's advantage estimator declared it needs (algos/registry.py)."""
        return ADVANTAGE_ESTIMATORS.needs[self.algo.advantage]

    def sequence_logprobs(
        self, model: nn.Module, batch: RolloutBatch, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        return sequence_logprobs(model, batch, self.config, with_entropy=with_entropy)

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch:
        """Drop unscored samples (and, for ReMax, prompts whose greedy decode got no reward);
        add π_old, π_ref, values, token rewards and advantages."""
        batch = self._usable(batch, metrics)
        loss_mask = batch.response_mask.clone()
        if self.algo.mask_truncated:
            loss_mask[batch.truncated] = 0.0
        batch.loss_mask = loss_mask
        if self.config.anchors_on_engine:
            batch.old_logprobs = batch.engine_logprobs
        elif self.recompute_old_logprobs:
            batch.old_logprobs = self._logprobs(self.policy, batch)
            # the engine's log-probs are their own stream: how far from the trainer's π_old (on-policy
            # runs measure it in the update's own forward instead, over the samples it trains on)
            metrics.update(
                rollout_mismatch(
                    batch.old_logprobs, batch.engine_logprobs, batch.response_mask, self.config.rollout.tis_cap
                )
            )
        if self.algo.kl.needs_reference:
            batch.ref_logprobs = self._reference_logprobs(batch)
        if self.critic is not None:
            batch.values = self._values(batch) * batch.response_mask
        batch = concat(self.ranks.gather(batch), pad_id=0)  # the step's whole batch (a pad under mask 0 is never read)
        if self.running_baseline is not None:  # after its value was read (_usable): the next step's
            self.running_baseline.update(batch.scores)
        batch.token_rewards = self._token_rewards(batch, metrics)
        batch.advantages, batch.returns = self._advantages(batch, metrics)
        return batch

    def _usable(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch:
        """The samples with a score and, where the estimator compares with one, a baseline
        (set as ``baseline_scores``); the dropped ones are counted in ``metrics``."""
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
        batch.baseline_scores = baseline
        return batch

    def _token_rewards(self, batch: RolloutBatch, metrics: dict[str, float]) -> Tensor:
        """``[B, T]``: each score on its response's last token, minus β·KL per token where the KL
        goes in the reward (docs/algorithms.md §3.2); the adaptive controller sees that KL.

        An episode's score is its return: the rewards its source placed on tokens
        (``turn_rewards``, a turn's on its last sampled token) plus what is left of the score,
        on the last sampled token, so the token rewards still sum to the score."""
        placed = batch.turn_rewards
        scores = batch.scores if placed is None else batch.scores - placed.sum(-1)
        kl_section = self.algo.kl
        if kl_section.placement != "reward":
            outcome = place_scores_at_last_token(scores, batch.response_mask)
            return outcome if placed is None else outcome + placed
        # the sampling policy's log-probs for the KL penalty: the trainer's π_old where computed,
        # else the engine's own report (one vocabulary: engine_logprobs are what the engine
        # said, old_logprobs the trainer's forward of the same weights, ref_logprobs π_ref)
        sampling_logprobs = batch.old_logprobs if batch.old_logprobs is not None else batch.engine_logprobs
        beta = self.kl_controller.value
        token_rewards, kl_metrics = shape_token_rewards(
            scores,
            sampling_logprobs,
            batch.ref_logprobs,
            batch.response_mask,
            beta,
            kind=kl_section.estimator,
            level=kl_section.level,
        )
        # kl/reward is the controller's input itself (the rollout policy's KL with the run's
        # estimator, per-sequence token mean); kl/ref, logged by the update, is k3 of the
        # policy being trained, a different number, so the two keep separate names
        reward_kl = float(kl_metrics["kl"])
        metrics["kl/reward"] = reward_kl
        metrics["kl/coef"] = beta
        self.kl_controller.update(reward_kl, len(batch))
        return token_rewards if placed is None else token_rewards + placed

    def _advantages(self, batch: RolloutBatch, metrics: dict[str, float]) -> tuple[Tensor, Tensor]:
        """(advantages, returns) of the run's estimator; a non-finite advantage stops the run."""
        options = dict(self.algo.advantage_options)
        if self.estimator_needs.reward_weights and "component_weights" not in options:
            options["component_weights"] = self.rewards_weights
        # components stay NaN where a reward does not apply to a prompt: GDPO leaves them out
        advantages, returns = ADVANTAGE_ESTIMATORS[self.algo.advantage](
            token_rewards=batch.token_rewards,
            response_mask=batch.response_mask,
            group_ids=batch.group_ids,
            values=batch.values,
            baseline_scores=batch.baseline_scores,
            reward_components=batch.reward_components,
            **options,
        )
        adv = advantages[batch.response_mask.bool()]
        if not bool(torch.isfinite(adv).all()):
            # a NaN advantage would only make its samples look inactive and skip them in silence
            raise TrainingDiverged(
                f"{int((~torch.isfinite(adv)).sum())} advantages of this batch are not finite (rewards from "
                f"{float(batch.scores.min()):g} to {float(batch.scores.max()):g}); check the scale of the rewards"
                + (" and the critic's values" if batch.values is not None else "")
            )
        if adv.numel():
            metrics["advantage/mean"] = float(adv.mean())
            metrics["advantage/std"] = float(adv.std(unbiased=False))
            metrics["advantage/abs_max"] = float(adv.abs().max())
        return advantages, returns

    def _baseline(self, batch: RolloutBatch) -> Tensor | None:
        if self.running_baseline is not None:  # updated with the whole batch's scores in prepare
            return torch.full_like(batch.scores, self.running_baseline.value)
        return batch.baseline_scores  # ReMax's greedy decode, scored by the source; None otherwise

    def _logprobs(self, model: nn.Module, batch: RolloutBatch) -> Tensor:
        chunks, real = self._chunks(model, batch, packed=self.config.padding_free)
        parts = [self.sequence_logprobs(model, chunk)[0] for chunk in chunks]
        return torch.cat(parts[:real]).cpu()  # the batch stays on the CPU between stages (devices.py)

    def _chunks(self, model: nn.Module, batch: RolloutBatch, packed: bool = False) -> tuple[list[RolloutBatch], int]:
        """(chunks within ``micro_batch_size`` samples and ``micro_batch_tokens`` tokens, how many
        are real): a sharded model's ranks all run as many forward passes as the busiest (each is
        a collective), the others repeating their first chunk, whose results are dropped."""
        config, width = self.config, batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
        # a padded chunk keeps the batch's width (the parts are joined), so that is each sample's
        # cost; a packed one computes each sample's own tokens
        prompts, responses = batch.lengths() if packed else ([width] * len(batch), [0] * len(batch))
        bounds = micro_batch_bounds(
            prompts, responses, config.micro_batch_size, config.micro_batch_tokens, packed=packed
        )
        chunks = [batch.select(torch.arange(start, end)) for start, end in bounds]
        # (a light critic runs the sharded policy: models/adapter_critic.py)
        rounds = self.ranks.most(len(chunks)) if is_sharded(model) or is_sharded(self.policy) else len(chunks)
        return chunks + [chunks[0]] * (rounds - len(chunks)), len(chunks)

    def _values(self, batch: RolloutBatch) -> Tensor:
        """``[B, T]`` critic values of the batch, ``micro_batch_size`` samples per forward pass."""
        from posttrain.models.value import response_values

        device = model_device(self.critic)
        parts = []
        chunks, real = self._chunks(self.critic, batch)
        for chunk in chunks:
            chunk = chunk.to(device)
            with compute_precision(self.config.precision, device):
                values = response_values(self.critic, chunk.input_ids, chunk.attention_mask, chunk.prompt_ids.shape[1])
            parts.append(values.float().cpu())
        return torch.cat(parts[:real])

    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        if self.reference is not None:
            return self._logprobs(self.reference, batch)
        from posttrain.models.lora import reference_policy

        with reference_policy(self.policy):
            return self._logprobs(self.policy, batch)
