"""Rule-based ("verifiable") rewards from the seeds: exact match, the reversal check, format
tags, line counts and length. All follow the reward signature of ``registry.py``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.algos.sampling import overlong_reward_penalty
from posttrain.data.tasks.preference import true_preference_score
from posttrain.data.tasks.reverse import reverse_reward
from posttrain.rewards.registry import register_reward

REFERENCE_COLUMNS = ("answer", "solution", "reference", "target")


def reference_column(reward: str, columns: Mapping[str, Any]) -> Sequence[Any]:
    """The ground-truth column a reward compares with: the first of answer, solution,
    reference, target that the dataset has."""
    for name in REFERENCE_COLUMNS:
        if name in columns:
            return columns[name]
    raise ValueError(
        f"reward {reward!r} needs a ground-truth column named one of {', '.join(REFERENCE_COLUMNS)}; "
        f"the dataset has: {', '.join(sorted(columns)) or 'no extra columns'}"
    )


def completion_text(completion: Any) -> str:
    """Plain text of a completion; for conversational data, the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    return str(completion)


@register_reward("exact_match")
def exact_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any):
    """1.0 when the stripped completion equals the stripped reference column, else 0.0."""
    references = reference_column("exact_match", columns)
    return [
        float(completion_text(c).strip() == str(ref).strip()) for c, ref in zip(completions, references, strict=True)
    ]


register_reward("reverse")(reverse_reward)


@register_reward("preference_rule")
def preference_rule(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any):
    """The rule that labels the synthetic preference task (``data.tasks.preference``): the
    "true" preference a learned reward model only approximates. Logged beside a reward model
    with weight 0, it measures reward over-optimisation as it happens."""
    return [true_preference_score(str(p), completion_text(c)) for p, c in zip(prompts, completions, strict=True)]


# R1-Zero's template: the whole response is a think block followed by an answer block.
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


@register_reward("format")
def think_answer_format(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any):
    """1.0 when the response is ``<think> … </think> <answer> … </answer>`` and nothing else.

    When the prompt already ends with ``<think>`` (a template that opens the block for the
    model), the response is checked as if it began with it. Source: DeepSeek-AI,
    "DeepSeek-R1", 2025, §2.2.2 (format reward).
    """
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = completion_text(completion)
        if isinstance(prompt, str) and prompt.rstrip().endswith("<think>") and "<think>" not in text:
            text = "<think>" + text
        scores.append(float(bool(_FORMAT.match(text))))
    return scores


@register_reward("line_count")
class LineCount:
    """−|number of non-empty lines − target|: the seed's "write a 5-line poem" reward.

    The target is the ``target_lines`` column when the dataset has one, else ``target``."""

    def __init__(self, target: int = 5) -> None:
        self.target = target

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any):
        targets = columns.get("target_lines", [self.target] * len(completions))
        return [
            -abs(len([line for line in completion_text(c).splitlines() if line.strip()]) - int(t))
            for c, t in zip(completions, targets, strict=True)
        ]


@register_reward("length")
class LengthReward:
    """−|characters − target| / target: prefer responses near a target length."""

    def __init__(self, target: int = 100) -> None:
        if target <= 0:
            raise ValueError(f"length target must be positive, got {target}")
        self.target = target

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any):
        return [-abs(len(completion_text(c)) - self.target) / self.target for c in completions]


@register_reward("overlong")
class OverlongPenalty:
    """DAPO's soft overlong punishment on the token length (docs/algorithms.md §7.2): 0 up to
    max_length − cache_length, then linear down to −factor at max_length."""

    def __init__(self, max_length: int, cache_length: int, factor: float = 1.0) -> None:
        if not 0 < cache_length <= max_length:
            raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}")
        self.max_length, self.cache_length, self.factor = max_length, cache_length, factor

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        **columns: Any,
    ):
        import torch

        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float32)
        return overlong_reward_penalty(lengths, self.max_length, self.cache_length, self.factor).tolist()
