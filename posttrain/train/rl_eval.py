"""What an RL run reports besides its step metrics: held-out evaluation (greedy completions of
the held-out prompts, ended by the same stop strings as the samples, scored by the run's
rewards) and the sample records of samples.jsonl."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.evaluate import EvalResult, evaluate, pass_at_k
from posttrain.rewards import RewardSet
from posttrain.train.rl_batch import RolloutBatch
from posttrain.train.rl_config import RLRun


def evaluate_held_out(
    policy: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], rewards: RewardSet, config: RLRun
) -> tuple[dict[str, float], EvalResult]:
    """``eval/reward`` (the mean score), ``eval/accuracy`` when a single reward scores 0/1, and
    each function's ``eval/<name>/mean`` and ``/solved`` when there are several, and with
    ``eval_k`` > 0 ``eval/pass_at_k`` (``eval_k`` completions per prompt sampled at the run's
    temperature, from the same seed at every evaluation); with the samples. The policy is back
    in training mode afterwards."""
    components: list[Tensor] = []

    def score(prompts: list[Any], completions: list[str], completion_ids: list[list[int]], **columns: Any) -> list:
        result = rewards.score(prompts, completions, completion_ids, columns)
        components.append(result.components)
        return [None if math.isnan(v) else v for v in result.scores.tolist()]

    result = evaluate(
        policy,
        tokenizer,
        rows,
        score,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.eval_batch_size,
        stop=config.sampling.stop,
    )
    # each function's own scores of the greedy completions, before pass@k's samples add theirs
    table = torch.cat(components) if len(rewards.names) > 1 else None
    metrics = {"eval/reward": result.accuracy}
    if config.eval_k:
        metrics["eval/pass_at_k"] = pass_at_k(
            policy, tokenizer, rows, score, k=config.eval_k, temperature=config.temperature_value,
            max_new_tokens=config.max_new_tokens, seed=config.seed, stop=config.sampling.stop,
        )  # fmt: skip
    policy.train()
    values = [s["reward"] for s in result.samples if s["reward"] is not None]
    if table is not None:  # each function's own mean, weight-0 (monitoring) ones included
        for index, name in enumerate(rewards.names):
            metrics[f"eval/{name}/mean"] = float(table[:, index].nanmean())
            # full marks: a task scorer's partial credit (reasoning-gym gives 0.01 for a
            # wrong number) would otherwise read as accuracy in the mean
            metrics[f"eval/{name}/solved"] = float((table[:, index] >= 1.0).float().mean())
    if len(rewards.names) == 1 and values and all(v in (0.0, 1.0) for v in values):
        metrics["eval/accuracy"] = result.accuracy
    return metrics, result


class HeldOutCompletions:
    """Evaluation of a single-turn run: :func:`evaluate_held_out` of the policy now; keeps the
    last result (``last_result``) for callers that print its samples. An environment source
    evaluates its own way (``EnvironmentSource.evaluate``): the loop holds either."""

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: RewardSet, config: RLRun) -> None:
        self.policy, self.tokenizer, self.rewards, self.config = policy, tokenizer, rewards, config
        self.last_result: EvalResult | None = None

    def evaluate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        metrics, self.last_result = evaluate_held_out(self.policy, self.tokenizer, rows, self.rewards, self.config)
        return metrics


def logged_samples(batch: RolloutBatch, count: int) -> list[dict[str, Any]]:
    """The first ``count`` samples of a prepared batch as samples.jsonl records: prompt,
    completion, reward (None where unscored) and the sample's first-token advantage."""
    return [
        {
            "prompt": batch.prompts[i] if isinstance(batch.prompts[i], str) else str(batch.prompts[i]),
            "completion": batch.completions[i],
            "reward": None if math.isnan(float(batch.scores[i])) else float(batch.scores[i]),
            "advantage": float(batch.advantages[i][batch.response_mask[i].bool()][:1].sum()),
        }
        for i in range(min(count, len(batch)))
    ]
