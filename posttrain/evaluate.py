"""Evaluation: generate completions for held-out prompts and score them with a reward function.

Greedy (:func:`evaluate`): one completion per prompt; with a 0/1 reward such as
``reverse_reward`` the mean reward is the exact-match accuracy. Sampled (:func:`sampled_eval`):
k completions per prompt at a temperature, giving pass@k (the share of prompts with at least one
full score) and mean@k (the mean score over all samples: the expected accuracy of one sample).
Each mean comes with its standard error over the prompts, so two models' figures can be told
apart from noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.chat import prompt_ids
from posttrain.rewards.registry import call_reward
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams

RewardFn = Callable[..., list[float | None]]


@dataclass
class EvalResult:
    accuracy: float
    """Mean reward over the rows the reward applies to (those not scored ``None``)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """One dict per row: its columns, the generated ``completion`` (a reference completion in
    the row is kept as ``reference``) and its ``reward``."""

    @property
    def stderr(self) -> float:
        """Standard error of :attr:`accuracy` over the scored rows (NaN below two)."""
        return standard_error([s["reward"] for s in self.samples if s["reward"] is not None])


@dataclass
class SampledResult:
    """k sampled completions per prompt, scored (:func:`sampled_eval`)."""

    k: int
    scores: list[list[float]]
    """Per prompt, the scores of its samples that the reward applies to (``None`` left out)."""

    @property
    def pass_at_k(self) -> float:
        """Share of prompts with at least one sample scoring 1."""
        return sum(any(s == 1.0 for s in row) for row in self.scores) / max(len(self.scores), 1)

    @property
    def mean_at_k(self) -> float:
        """Mean over prompts of the mean score of their samples."""
        means = self._prompt_means()
        return sum(means) / len(means) if means else float("nan")

    @property
    def mean_at_k_stderr(self) -> float:
        """Standard error of :attr:`mean_at_k` (prompts are the independent draws, not samples)."""
        return standard_error(self._prompt_means())

    def _prompt_means(self) -> list[float]:
        return [sum(row) / len(row) for row in self.scores if row]


def standard_error(values: Sequence[float]) -> float:
    """Sample standard deviation / √n of ``values`` (NaN for fewer than two)."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def generate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 12,
    batch_size: int = 256,
    stop: Sequence[str] = (),
) -> tuple[list[str], list[list[int]]]:
    """Greedy completions of `prompts`: (texts without special tokens, ids up to and incl. EOS
    or the end of a `stop` string).

    Uses the rollout engine the RL loop samples with, so evaluation sees exactly the
    policy that training optimises.
    """
    sampling = SamplingParams(greedy=True, max_new_tokens=max_new_tokens, stop_strings=tuple(stop))
    texts, ids = sample_completions(model, tokenizer, prompts, sampling, batch_size=batch_size)
    return texts, ids


def sample_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    sampling: SamplingParams,
    *,
    batch_size: int = 256,
) -> tuple[list[str], list[list[int]]]:
    """``sampling.n`` completions per prompt (prompt-major): texts and token ids."""
    engine = build_engine(model, tokenizer)
    texts: list[str] = []
    ids: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [prompt_ids(tokenizer, p) for p in prompts[start : start + batch_size]]
        out = engine.generate(chunk, sampling)
        for row, length in zip(out.response_ids.tolist(), out.response_lengths.tolist(), strict=True):
            ids.append(row[:length])
            texts.append(tokenizer.decode(row[:length], skip_special_tokens=True))
    return texts, ids


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    *,
    max_new_tokens: int = 12,
    batch_size: int = 256,
    stop: Sequence[str] = (),
) -> EvalResult:
    """Generate greedily for each row's "prompt" and score with `reward_fn` (TRL's signature).

    Every other column of the rows reaches `reward_fn` as a keyword list, as in training, and
    completions after a conversational prompt arrive as assistant messages, as in TRL.
    `stop` ends completions as the RL run's ``sampling.stop`` does: a policy trained with stop
    strings never learns what comes after them, and the reward should not read it.
    """
    prompts = [row["prompt"] for row in rows]
    completions, completion_ids = generate_greedy(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, stop=stop
    )
    # TRL passes every column except these three; a reference "completion" would otherwise
    # collide with the generated one.
    extra = [key for key in (rows[0] if rows else {}) if key not in ("prompt", "completion", "completion_ids")]
    columns = {k: [row[k] for row in rows] for k in extra}
    rewards = call_reward(reward_fn, prompts, completions, completion_ids, columns)
    scored = [r for r in rewards if r is not None]
    samples = []
    for row, completion, reward in zip(rows, completions, rewards, strict=True):
        sample = {**{k: row[k] for k in extra}, "prompt": row["prompt"], "completion": completion}
        if "completion" in row:
            sample["reference"] = row["completion"]
        samples.append({**sample, "reward": reward})
    return EvalResult(accuracy=sum(scored) / len(scored) if scored else float("nan"), samples=samples)


def pass_at_k(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *args: Any, **kwargs: Any) -> float:
    """Share of prompts with at least one of ``k`` sampled completions scoring 1 (pass@k); the
    arguments of :func:`sampled_eval`."""
    return sampled_eval(model, tokenizer, *args, **kwargs).pass_at_k


def sampled_eval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    *,
    k: int,
    temperature: float = 1.0,
    max_new_tokens: int = 12,
    seed: int = 0,
    stop: Sequence[str] = (),
    batch_size: int = 256,
) -> SampledResult:
    """``k`` completions per row's prompt sampled at ``temperature`` (seeded), scored: pass@k and
    mean@k. ``stop`` ends completions as in :func:`evaluate` and the RL run's ``sampling.stop``.
    ``batch_size`` counts sequences, as the greedy pass's does: ``batch_size // k`` prompts (at
    least one) are generated at once, so the KV cache stays the size the greedy pass's is."""
    prompts = [row["prompt"] for row in rows]
    sampling = SamplingParams(
        n=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, stop_strings=tuple(stop)
    )
    per_batch = max(1, batch_size // k)
    completions, completion_ids = sample_completions(model, tokenizer, prompts, sampling, batch_size=per_batch)
    extra = [key for key in (rows[0] if rows else {}) if key not in ("prompt", "completion", "completion_ids")]
    columns = {key: [row[key] for row in rows for _ in range(k)] for key in extra}
    prompts = [p for p in prompts for _ in range(k)]
    rewards = call_reward(reward_fn, prompts, completions, completion_ids, columns)
    scores = [[float(r) for r in rewards[i * k : (i + 1) * k] if r is not None] for i in range(len(rows))]
    return SampledResult(k=k, scores=scores)
