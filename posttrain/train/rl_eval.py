"""What an RL run measures with its policy besides training: held-out evaluation (greedy
completions of the held-out prompts, ended by the same stop strings as the samples, scored by
the run's rewards), the difficulty filter's pass rates of the training prompts, and the sample
records of samples.jsonl."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.data.difficulty import DifficultyFilter, filter_rows
from posttrain.data.loading import DataError
from posttrain.evaluate import EvalResult, evaluate, sampled_eval
from posttrain.rewards import RewardSet
from posttrain.train.rl_batch import RolloutBatch
from posttrain.train.rl_config import RLRun


def evaluate_held_out(
    policy: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], rewards: RewardSet, config: RLRun
) -> tuple[dict[str, float], EvalResult]:
    """``eval/reward`` (the mean score), ``eval/accuracy`` when a single reward scores 0/1, and
    each function's ``eval/<name>/mean`` and ``/solved`` when there are several, and with
    ``eval_k`` > 0 ``eval/pass_at_k`` and ``eval/mean_at_k`` (``eval_k`` completions per prompt
    sampled at the run's temperature, from the same seed at every evaluation: the share of prompts
    with a full score among them, and their mean score); with the samples. The policy is back
    in training mode afterwards."""
    components: list[Tensor] = []
    score = _scorer(rewards, components)
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
        sampled = sampled_eval(
            policy, tokenizer, rows, score, k=config.eval_k, temperature=config.temperature_value,
            max_new_tokens=config.max_new_tokens, seed=config.seed, stop=config.sampling.stop,
            batch_size=config.eval_batch_size,
        )  # fmt: skip
        metrics["eval/pass_at_k"], metrics["eval/mean_at_k"] = sampled.pass_at_k, sampled.mean_at_k
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


def filter_by_difficulty(
    policy: nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    rewards: RewardSet,
    config: RLRun,
    echo: Any,
) -> tuple[list[dict[str, Any]], DifficultyFilter]:
    """``data.filter``: the training rows whose pass rate under the starting policy lies in range
    (data/difficulty.py), k completions each sampled as the run samples (temperature, length,
    stop strings), scored by the run's rewards; a resumed run reads the rates it measured."""

    def measure(chosen: Sequence[dict[str, Any]], k: int) -> list[list[float]]:
        column = config.data.prompt_column  # the evaluation reads "prompt"
        chosen = [{**row, "prompt": row[column]} for row in chosen]
        result = sampled_eval(
            policy, tokenizer, chosen, _scorer(rewards), k=k, temperature=config.temperature_value,
            max_new_tokens=config.max_new_tokens, seed=config.seed, stop=config.sampling.stop,
            batch_size=config.eval_batch_size,
        )  # fmt: skip
        return result.scores

    resuming = config.resume != "none"
    kept, result = filter_rows(rows, config.data.filter, measure, Path(config.output_dir), resuming)
    policy.train()
    echo(f"[data] difficulty filter: {result.summary()}")
    if len(kept) < config.prompts_per_step:
        raise DataError(
            f"data.filter kept {len(kept)} prompts, fewer than prompts_per_step = {config.prompts_per_step}: "
            f"{result.summary()}; widen data.filter.pass_rate, raise data.filter.k, or add data"
        )
    return kept, result


def _scorer(rewards: RewardSet, components: list[Tensor] | None = None) -> Any:
    """The run's weighted reward as a TRL-style function (None where a sample is not scored);
    each call's per-function scores are appended to ``components`` when given."""

    def score(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **columns: Any) -> list:
        result = rewards.score(prompts, completions, completion_ids, columns)
        if components is not None:
            components.append(result.components)
        return [None if math.isnan(v) else v for v in result.scores.tolist()]

    return score


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
