"""Greedy evaluation: generate one completion per prompt and score it with a reward function.

With a 0/1 reward such as ``reverse_reward`` the mean reward is the exact-match accuracy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

RewardFn = Callable[..., list[float | None]]


@dataclass
class EvalResult:
    accuracy: float
    """Mean reward over the rows the reward applies to (those not scored ``None``)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """One dict per row: its columns, the generated ``completion`` (a reference completion in
    the row is kept as ``reference``) and its ``reward``."""


@torch.no_grad()
def generate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 12,
    batch_size: int = 256,
) -> tuple[list[str], list[list[int]]]:
    """Greedy completions of `prompts`: (texts without special tokens, ids up to and incl. EOS)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts: list[str] = []
    ids: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        # Left padding keeps every prompt's last token at the same position, so the new
        # tokens of all rows are appended in one column per step.
        encoded = tokenizer(
            list(prompts[start : start + batch_size]),
            add_special_tokens=False,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        ).to(device)
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row in output[:, encoded["input_ids"].shape[1] :].tolist():
            if tokenizer.eos_token_id in row:  # after EOS, generate only writes padding
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            ids.append(row)
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    model.train(was_training)
    return texts, ids


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    *,
    max_new_tokens: int = 12,
    batch_size: int = 256,
) -> EvalResult:
    """Generate greedily for each row's "prompt" and score with `reward_fn` (TRL's signature).

    Every other column of the rows reaches `reward_fn` as a keyword list, as in training.
    """
    prompts = [row["prompt"] for row in rows]
    completions, completion_ids = generate_greedy(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    # TRL passes every column except these three; a reference "completion" would otherwise
    # collide with the generated one.
    extra = [key for key in (rows[0] if rows else {}) if key not in ("prompt", "completion", "completion_ids")]
    rewards = reward_fn(prompts, completions, completion_ids, **{k: [row[k] for row in rows] for k in extra})
    scored = [r for r in rewards if r is not None]
    samples = []
    for row, completion, reward in zip(rows, completions, rewards, strict=True):
        sample = {**{k: row[k] for k in extra}, "prompt": row["prompt"], "completion": completion}
        if "completion" in row:
            sample["reference"] = row["completion"]
        samples.append({**sample, "reward": reward})
    return EvalResult(accuracy=sum(scored) / len(scored) if scored else float("nan"), samples=samples)
