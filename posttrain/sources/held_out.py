"""Held-out evaluation of a single-turn run: greedy completions of the held-out prompts, ended by
the same stop strings as the samples, scored by the run's rewards (an environment source
evaluates its own episodes: ``EnvironmentSource.evaluate``).

The evaluation interface the loop holds: ``evaluate(rows) -> metrics``, ``last_result`` (the last
evaluation's samples) and ``measure(rows, k)`` (k sampled scores of each row: the difficulty filter's)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.evaluate import EvalResult, evaluate, sampled_eval
from posttrain.rewards import RewardSet
from posttrain.sources.plan import SamplingPlan


def evaluate_held_out(
    policy: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], rewards: RewardSet, plan: SamplingPlan
) -> tuple[dict[str, float], EvalResult]:
    """``eval/reward`` (the mean score), ``eval/accuracy`` when a single reward scores 0/1, and
    each function's ``eval/<name>/mean`` and ``/solved`` when there are several, and with
    ``eval_k`` > 0 ``eval/pass_at_k`` and ``eval/mean_at_k`` (``eval_k`` completions per prompt
    sampled at the run's temperature, from the same seed at every evaluation: the share of prompts
    with a full score among them, and their mean score); with the samples. The policy is back
    in training mode afterwards."""
    components: list[Tensor] = []
    score = scorer(rewards, components)
    result = evaluate(
        policy,
        tokenizer,
        rows,
        score,
        max_new_tokens=plan.max_new_tokens,
        batch_size=plan.eval_batch_size,
        stop=plan.stop,
    )
    # each function's own scores of the greedy completions, before pass@k's samples add theirs
    table = torch.cat(components) if len(rewards.names) > 1 else None
    metrics = {"eval/reward": result.accuracy}
    if plan.eval_k:
        sampled = sampled_eval(
            policy, tokenizer, rows, score, k=plan.eval_k, temperature=plan.temperature,
            max_new_tokens=plan.max_new_tokens, seed=plan.seed, stop=plan.stop,
            batch_size=plan.eval_batch_size,
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


def scorer(rewards: RewardSet, components: list[Tensor] | None = None) -> Any:
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
    evaluates its own way (``EnvironmentSource.evaluate``): the loop holds either. Both also
    ``measure`` rows for the difficulty filter (``sources/difficulty_filter.py``)."""

    def __init__(
        self, policy: nn.Module, tokenizer: Any, rewards: RewardSet, plan: SamplingPlan, prompt_column: str = "prompt"
    ) -> None:
        self.policy, self.tokenizer, self.rewards, self.plan = policy, tokenizer, rewards, plan
        self.prompt_column = prompt_column
        self.last_result: EvalResult | None = None

    def evaluate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        metrics, self.last_result = evaluate_held_out(self.policy, self.tokenizer, rows, self.rewards, self.plan)
        return metrics

    def measure(self, rows: Sequence[dict[str, Any]], k: int) -> list[list[float]]:
        """``k`` completions of each row's prompt sampled as the run samples (temperature, length,
        stop strings), scored by the run's rewards: each row's scores (unscored ones left out)."""
        plan, column = self.plan, self.prompt_column  # the evaluation reads "prompt"
        chosen = [{**row, "prompt": row[column]} for row in rows]
        result = sampled_eval(
            self.policy, self.tokenizer, chosen, scorer(self.rewards), k=k, temperature=plan.temperature,
            max_new_tokens=plan.max_new_tokens, seed=plan.seed, stop=plan.stop, batch_size=plan.eval_batch_size,
        )  # fmt: skip
        self.policy.train()
        return result.scores
