"""The single-turn rollout source: each sample is one completion of a dataset prompt.

Per step it draws ``prompts_per_step`` rows (an epoch-wise shuffle, resumable), samples
``samples_per_prompt`` completions of each from the run's engine and scores them with the run's
rewards. What an algorithm asks of the data side besides (DAPO's dynamic sampling and overlong
shaping, ReMax's greedy baseline, a curriculum) wraps this source, or an environment's, from its
own module (``sources/dynamic_sampling.py``, ...): they call :meth:`SingleTurnSource.sample`
with a round index and :meth:`SingleTurnSource.greedy_scores`.

Under torchrun every rank draws the same ``prompts_per_step`` rows and generates its own share
of them (whole groups, ``distributed.py``), with group ids numbered as one process would; the
step's whole batch is assembled in batch preparation."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from posttrain.data.lengths import drop_overlong
from posttrain.data.sampler import EpochSampler
from posttrain.data.section import DataSection, data_source, encode_rows
from posttrain.distributed import world
from posttrain.models.chat import prompt_ids as encode_prompt
from posttrain.rewards import RewardSet
from posttrain.rewards.combine import combine, reward_applies
from posttrain.rollout.batch import RolloutBatch, from_rollouts
from posttrain.rollout.types import SamplingParams
from posttrain.sources.plan import SamplingPlan, sample_seed

Echo = Callable[[str], None]


class SingleTurnSource:
    """Scored single-turn batches from ``rows`` (see the module docstring).

    ``context_limit`` is the policy's context length: a prompt that leaves no room for
    ``max_new_tokens`` is refused or skipped as ``data.on_bad_row`` says (``data/lengths.py``).
    ``rows`` (those kept) and ``sampler`` (their order) are public: a curriculum replaces the sampler.
    """

    def __init__(
        self,
        plan: SamplingPlan,
        data: DataSection,
        engine: Any,
        tokenizer: Any,
        rows: Sequence[dict[str, Any]],
        rewards: RewardSet,
        context_limit: int | None,
        echo: Echo = print,
    ) -> None:
        self.plan, self.data, self.engine, self.tokenizer, self.rewards = plan, data, engine, tokenizer, rewards
        self.echo, self.prompt_column = echo, data.prompt_column
        self.rows, self.prompt_ids = self._prompts_within_context(rows, context_limit)
        self.sampler: Any = EpochSampler(len(self.rows), plan.prompts_per_step, plan.seed)
        self.ranks = world()

    def _prompts_within_context(
        self, rows: Sequence[dict[str, Any]], limit: int | None
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The rows whose prompt (a chat prompt the template refuses is a data error naming its
        row) leaves room for ``max_new_tokens``, and their token ids, kept aligned."""
        plan, source = self.plan, data_source(self.data)
        ids = encode_rows(lambda row: encode_prompt(self.tokenizer, row[self.prompt_column]), rows, source)
        lengths = [len(prompt) + plan.max_new_tokens for prompt in ids]
        kept = drop_overlong(
            list(zip(rows, ids, strict=True)),
            lengths,
            limit,
            what=f"prompts (+ max_new_tokens = {plan.max_new_tokens}) of {source}",
            on_bad_row=self.data.on_bad_row,
            echo=self.echo,
        )
        return [row for row, _ in kept], [prompt for _, prompt in kept]

    @property
    def pad_id(self) -> int:
        return self.engine.pad_id

    @property
    def single_reward(self) -> bool:
        """Whether the score is one function's (a 0/1 one is then reported as ``reward/accuracy``)."""
        return len(self.rewards.names) == 1

    @property
    def length_limit(self) -> int:
        """The most tokens the policy samples for one sample: ``max_new_tokens``."""
        return self.plan.max_new_tokens

    # ------------------------------------------------------------------ the RolloutSource protocol
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.sample(step)

    def sync_weights(self, version: int) -> None:
        self.engine.update_weights(version)  # vLLM: copies the new weights in; raises if it cannot

    def state_dict(self) -> dict[str, Any]:
        # the keys checkpoints have always used, so runs saved before sources existed resume
        return {"sampler": self.sampler.state_dict(), "rewards": self.rewards.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.sampler.load_state_dict(state["sampler"])
        return [f"reward {name!r}" for name in self.rewards.load_state_dict(state.get("rewards", {}))]

    def start(self) -> None:
        self.rewards.start()

    def close(self) -> None:
        self.rewards.close()

    # ------------------------------------------------------------------ sampling and scoring
    def sample(self, step: int, round_index: int = 0, group_offset: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        """Draw ``prompts_per_step`` rows, sample ``samples_per_prompt`` completions of each and
        score them; ``round_index`` (dynamic sampling's further draws of a step) and
        ``group_offset`` (their groups numbered after the earlier rounds') seed and number them."""
        plan = self.plan
        # this rank's share of the rows every rank drew; its groups numbered as in one process
        indices = self.ranks.share(self.sampler.next_batch(), "prompts_per_step")
        group_offset += self.ranks.rank * len(indices)
        rows = [self.rows[i] for i in indices]
        seed = sample_seed(plan.seed, step, round_index, self.ranks.rank)
        t0 = time.perf_counter()
        rollouts = self.engine.generate(
            [self.prompt_ids[i] for i in indices], plan.params(seed=seed, n=plan.samples_per_prompt)
        )
        t1 = time.perf_counter()
        batch = from_rollouts(rollouts, self.tokenizer, rows, self.prompt_column, group_offset)
        result = self.rewards.score(
            batch.prompts, batch.completions, batch.completion_ids, batch.columns, group_ids=batch.group_ids
        )
        t2 = time.perf_counter()
        batch.scores, batch.reward_components = result.scores, result.components
        metrics = dict(result.metrics)  # the reward/* summary of the draw: sources/reward_metrics.py
        metrics.update({"time/generate_s": t1 - t0, "time/reward_s": t2 - t1})
        metrics["throughput/generated_tokens_per_s"] = float(batch.response_mask.sum()) / max(t1 - t0, 1e-9)
        return batch, metrics

    def greedy_scores(self, batch: RolloutBatch) -> Tensor:
        """ReMax: the reward of one greedy completion per prompt, for every sample of that prompt,
        summed over the same rewards as the prompt's samples; NaN when the greedy completion
        has no score from one of them (the loop then drops the prompt, never compares with 0)."""
        groups, first = torch.unique(batch.group_ids, return_inverse=True)
        representative = [int(torch.nonzero(first == g)[0]) for g in range(groups.numel())]
        prompts = [batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() for i in representative]
        greedy_sampling = SamplingParams(
            greedy=True, max_new_tokens=self.plan.max_new_tokens, stop_strings=self.plan.stop
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
