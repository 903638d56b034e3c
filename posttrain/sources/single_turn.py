"""The single-turn rollout source: each sample is one completion of a dataset prompt.

Per step it draws ``prompts_per_step`` rows (an epoch-wise shuffle, resumable), samples
``samples_per_prompt`` completions of each from the run's engine, scores them with the run's
rewards and applies what the algorithm asks of the data side: DAPO's dynamic sampling (groups
whose rewards are all equal are dropped and more prompts drawn, docs/algorithms.md §7.1),
DAPO's overlong shaping (§7.2) and ReMax's greedy baseline (§2.5: one greedy completion per
prompt, scored by the same rewards).

Under torchrun every rank draws the same ``prompts_per_step`` rows and generates its own share
of them (whole groups, ``distributed.py``), with group ids numbered as one process would; the
step's whole batch is assembled in batch preparation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from posttrain.algos import group_stats, overlong_reward_penalty
from posttrain.algos.sampling import dapo_group_filter
from posttrain.data.lengths import drop_overlong
from posttrain.data.section import data_source, encode_rows
from posttrain.distributed import world
from posttrain.models.chat import prompt_ids as encode_prompt
from posttrain.rewards import RewardSet
from posttrain.rewards.combine import combine, reward_applies
from posttrain.rollout.types import SamplingParams
from posttrain.train.rl_batch import RolloutBatch, concat, from_rollouts
from posttrain.train.rl_config import RLRun
from posttrain.train.sampler import build_sampler

Echo = Callable[[str], None]


class SingleTurnSource:
    """Scored single-turn batches from ``rows`` (see the module docstring).

    ``context_limit`` is the policy's context length: a prompt that leaves no room for
    ``max_new_tokens`` is refused or skipped as ``data.on_bad_row`` says (``data/lengths.py``).
    """

    def __init__(
        self,
        config: RLRun,
        engine: Any,
        tokenizer: Any,
        rows: Sequence[dict[str, Any]],
        rewards: RewardSet,
        context_limit: int | None,
        echo: Echo = print,
    ) -> None:
        self.config, self.engine, self.tokenizer, self.rewards, self.echo = config, engine, tokenizer, rewards, echo
        self.prompt_column = config.data.prompt_column
        self.rows, self.prompt_ids = self._prompts_within_context(rows, context_limit)
        self.sampler = build_sampler(self.rows, config.prompts_per_step, config.seed, config.data.curriculum)
        self.ranks = world()
        self.prompts_here = config.prompts_per_step // self.ranks.size  # this rank's share of a step's
        # the lowest score seen in the run: a batch whose every score is the best one is "every
        # prompt learned" only if lower scores were ever seen (else the reward may be constant)
        self.lowest_score = math.inf

    def _prompts_within_context(
        self, rows: Sequence[dict[str, Any]], limit: int | None
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The rows whose prompt (a chat prompt the template refuses is a data error naming its
        row) leaves room for ``max_new_tokens``, and their token ids, kept aligned."""
        config = self.config
        source = data_source(config.data)
        ids = encode_rows(lambda row: encode_prompt(self.tokenizer, row[self.prompt_column]), rows, source)
        lengths = [len(prompt) + config.max_new_tokens for prompt in ids]
        kept = drop_overlong(
            list(zip(rows, ids, strict=True)),
            lengths,
            limit,
            what=f"prompts (+ max_new_tokens = {config.max_new_tokens}) of {source}",
            on_bad_row=config.data.on_bad_row,
            echo=self.echo,
        )
        return [row for row, _ in kept], [prompt for _, prompt in kept]

    # ------------------------------------------------------------------ the RolloutSource protocol
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics = self._collect(step)
        if self.config.algorithm.baseline == "greedy" and len(batch):
            t0 = time.perf_counter()
            batch.baseline_scores = self._greedy_baseline(batch)
            metrics["time/baseline_s"] = time.perf_counter() - t0
        return batch, metrics

    def sync_weights(self, version: int) -> None:
        self.engine.update_weights(version)  # vLLM: copies the new weights in; raises if it cannot

    def state_dict(self) -> dict[str, Any]:
        # the keys checkpoints have always used, so runs saved before sources existed resume
        state = {"sampler": self.sampler.state_dict(), "rewards": self.rewards.state_dict()}
        return {**state, "lowest_score": self.lowest_score}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.sampler.load_state_dict(state["sampler"])
        self.lowest_score = float(state.get("lowest_score", math.inf))  # absent before session 26
        return [f"reward {name!r}" for name in self.rewards.load_state_dict(state.get("rewards", {}))]

    def start(self) -> None:
        self.rewards.start()

    def close(self) -> None:
        self.rewards.close()

    # ------------------------------------------------------------------ sampling and scoring
    def _collect(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample and score ``prompts_per_step`` groups. With dynamic sampling, groups whose
        rewards are all equal are dropped and further prompts sampled, up to ``max_rounds``."""
        config, dynamic = self.config, self.config.algorithm.dynamic_sampling
        rounds = dynamic.max_rounds if dynamic.enabled else 1
        kept: list[RolloutBatch] = []
        kept_groups, metrics = 0, {"time/generate_s": 0.0, "time/reward_s": 0.0}
        drawn, draw = 0, None
        for round_index in range(rounds):
            batch, round_metrics = self._sample_and_score(step, round_index, group_offset=drawn)
            drawn += config.prompts_per_step
            if round_index == 0:  # the step's draw, before dynamic sampling drops any group
                draw = batch
                metrics.update(round_metrics)
                metrics.update(self.sampler.observe(batch.scores, self.ranks))
            else:
                metrics["time/generate_s"] += round_metrics["time/generate_s"]
                metrics["time/reward_s"] += round_metrics["time/reward_s"]
            if dynamic.enabled:
                batch = batch.select(torch.nonzero(_groups_with_signal(batch)).flatten())
            kept.append(batch)
            kept_groups += int(batch.group_ids.unique().numel())
            if kept_groups >= self.prompts_here:
                break
        batch = concat(kept, self.engine.pad_id)
        if dynamic.enabled:
            groups = batch.group_ids.unique(sorted=False)[: self.prompts_here]
            none_kept = groups.numel() == 0
            # none kept: the step trains on its draw as without dynamic sampling, whose advantages
            # are all 0 (a step that trains no sample), rather than on an empty batch
            batch = draw if none_kept else batch.select(torch.nonzero(torch.isin(batch.group_ids, groups)).flatten())
            metrics["dynamic_sampling/rounds"] = round_index + 1
            metrics["dynamic_sampling/kept_groups"] = float(groups.numel())
            if groups.numel() < self.prompts_here and step % 10 == 1:
                self.echo(
                    f"[warning] step {step}: dynamic sampling kept {groups.numel()} of {self.prompts_here} "
                    f"groups after {rounds} rounds; training on {'the first draw' if none_kept else 'what was kept'} "
                    "(raise algorithm.dynamic_sampling.max_rounds)"
                )
        return batch, metrics

    def _sample_and_score(
        self, step: int, round_index: int, group_offset: int
    ) -> tuple[RolloutBatch, dict[str, float]]:
        config, overlong = self.config, self.config.algorithm.overlong
        # this rank's share of the rows every rank drew; its groups numbered as in one process
        indices = self.ranks.share(self.sampler.next_batch(), "prompts_per_step")
        group_offset += self.ranks.rank * len(indices)
        rows = [self.rows[i] for i in indices]
        sampling = SamplingParams(
            n=config.samples_per_prompt,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature_value,
            top_p=config.sampling.top_p,
            top_k=config.sampling.top_k,
            stop_strings=tuple(config.sampling.stop),
            # derived from (seed, step, round, rank), so a resumed run samples exactly the same tokens
            seed=(config.seed * 1_000_003 + step * 1009 + round_index + self.ranks.rank * 7_919_317) % 2**62,
        )
        t0 = time.perf_counter()
        rollouts = self.engine.generate([self.prompt_ids[i] for i in indices], sampling)
        t1 = time.perf_counter()
        batch = from_rollouts(rollouts, self.tokenizer, rows, self.prompt_column, group_offset)
        result = self.rewards.score(
            batch.prompts, batch.completions, batch.completion_ids, batch.columns, group_ids=batch.group_ids
        )
        t2 = time.perf_counter()
        scores = result.scores
        if overlong.enabled:
            penalty = overlong_reward_penalty(
                batch.response_mask.sum(-1), config.max_new_tokens, overlong.cache_length, overlong.factor
            )
            scores = scores + penalty
        batch.scores, batch.reward_components = scores, result.components
        metrics = {**result.metrics, **self._reward_metrics(batch)}
        metrics.update({"time/generate_s": t1 - t0, "time/reward_s": t2 - t1})
        metrics["throughput/generated_tokens_per_s"] = float(batch.response_mask.sum()) / max(t1 - t0, 1e-9)
        return batch, metrics

    def _reward_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        metrics, self.lowest_score = reward_metrics(batch, len(self.rewards.names) == 1, self.lowest_score)
        return metrics

    def _greedy_baseline(self, batch: RolloutBatch) -> Tensor:
        """ReMax: the reward of one greedy completion per prompt, for every sample of that prompt,
        summed over the same rewards as the prompt's samples; NaN when the greedy completion
        has no score from one of them (the loop then drops the prompt, never compares with 0)."""
        groups, first = torch.unique(batch.group_ids, return_inverse=True)
        representative = [int(torch.nonzero(first == g)[0]) for g in range(groups.numel())]
        prompts = [batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() for i in representative]
        greedy_sampling = SamplingParams(
            greedy=True, max_new_tokens=self.config.max_new_tokens, stop_strings=tuple(self.config.sampling.stop)
        )
        rollouts = self.engine.generate(prompts, greedy_sampling)
        rows = [
            {self.prompt_column: batch.prompts[i], **{k: v[i] for k, v in batch.columns.items()}}
            for i in representative
        ]
        greedy = from_rollouts(rollouts, self.tokenizer, rows, self.prompt_column)
        result = self.rewards.score(greedy.prompts, greedy.completions, greedy.completion_ids, greedy.columns)
        applies = reward_applies(batch.reward_components, batch.group_ids)[representative]
        failed = result.failed if result.failed is not None else torch.zeros_like(applies)
        return combine(result.components, result.weights, applies, failed)[first]


def _groups_with_signal(batch: RolloutBatch) -> Tensor:
    """``[B]`` keep mask of DAPO's dynamic sampling, judged on the scored samples only: a
    missing score read as 0 would make [1, 1, None, 1] look like a group with signal. Unscored
    samples of a kept group stay (the loop's batch preparation drops and counts them)."""
    scored = ~batch.scores.isnan()
    keep = dapo_group_filter(batch.scores[scored], batch.group_ids[scored])
    return torch.isin(batch.group_ids, batch.group_ids[scored][keep])


def _zero_variance_shares(
    std: Tensor, size: Tensor, scores: Tensor, group_ids: Tensor, lowest_seen: float
) -> tuple[float, float]:
    """(share of groups of more than one sample whose rewards are all equal, share of those
    equal groups sitting at the batch's highest reward — prompts the policy has learned).

    "Learned" needs a reward that has been lower before (``lowest_seen``, over the run): a
    reward that is constant (or went flat) gives batches whose every score is the batch's best,
    and reading those as every prompt learned would silence the warnings about it; a policy
    that solves every prompt of a batch after earlier failures has learned them."""
    _, first = torch.unique(group_ids, return_inverse=True)
    best = float(scores.max())
    spread = lowest_seen < best
    equal: dict[int, bool] = {}
    solved: dict[int, bool] = {}
    for index, group in enumerate(first.tolist()):
        if group not in equal and int(size[index]) > 1:
            equal[group] = bool(std[index] == 0)
            solved[group] = equal[group] and spread and float(scores[index]) == best
    zero = sum(equal.values())
    return zero / max(len(equal), 1), sum(solved.values()) / max(zero, 1)


def reward_metrics(batch: RolloutBatch, single_reward: bool, lowest_seen: float) -> tuple[dict[str, float], float]:
    """The step's ``reward/*`` and ``response/*`` metrics of a scored batch, and the lowest score
    seen in the run so far (``lowest_seen`` updated; see :func:`_zero_variance_shares`).
    ``reward/accuracy`` only for a single 0/1 reward: a sum of several that happens to be 0/1
    is no accuracy. Response lengths count the policy's tokens (``response_mask``)."""
    scores = batch.scores
    present = ~scores.isnan()
    valid = scores[present]
    lengths = batch.response_mask.sum(-1)
    metrics = {
        "reward/mean": float(valid.mean()) if valid.numel() else math.nan,
        "reward/std": float(valid.std(unbiased=False)) if valid.numel() else math.nan,
        "reward/none_fraction": 1.0 - float(present.float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": float(batch.truncated.float().mean()),
    }
    if single_reward and valid.numel() and bool(((valid == 0) | (valid == 1)).all()):
        metrics["reward/accuracy"] = float(valid.mean())
    if present.any():
        stats = group_stats(valid, batch.group_ids[present])
        lowest_seen = min(lowest_seen, float(valid.min()))
        zero, at_max = _zero_variance_shares(stats.std, stats.size, valid, batch.group_ids[present], lowest_seen)
        metrics["reward/zero_variance_group_fraction"] = zero
        metrics["reward/zero_variance_at_max_fraction"] = at_max
    return metrics, lowest_seen
