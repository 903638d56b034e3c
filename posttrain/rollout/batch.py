"""The rollout batch the RL loop passes from stage to stage (docs/design.md, "The data that flows").

Created from the engine's :class:`~posttrain.rollout.types.Rollouts`, filled by the rewards
(``scores``, ``reward_components``) and the algorithm (``token_rewards``, ``advantages``,
``returns``), consumed by the update. Everything is a plain tensor or list, so a batch can
later cross a process boundary unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posttrain.rollout.types import Rollouts

# dataset columns that a reward function receives under other names (TRL's convention)
RESERVED_COLUMNS = ("prompt", "completion", "completion_ids", "prompts", "completions")


@dataclass
class RolloutBatch:
    """B samples: ``prompts_per_step × samples_per_prompt``, prompt-major, ``[B, T]`` over the response."""

    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] long
    response_ids: Tensor  # [B, T] long, right-padded
    response_mask: Tensor  # [B, T] float, 1 on tokens the policy produced
    engine_logprobs: Tensor  # [B, T] float32, log-probs the sampler reported
    group_ids: Tensor  # [B] long, samples of one prompt share an id (unique within a step)
    truncated: Tensor  # [B] bool, cut by max_new_tokens
    policy_version: Tensor  # [B] long, the (oldest) weights version that sampled the sample
    prompts: list[Any]  # [B] prompt text (or chat messages) per sample
    completions: list[str]  # [B] decoded completions
    columns: dict[str, list[Any]]  # other dataset columns, per sample
    scores: Tensor | None = None  # [B] weighted reward; NaN where no function applied
    reward_components: Tensor | None = None  # [B, K]
    loss_mask: Tensor | None = None  # [B, T] response_mask minus samples left out of the loss
    old_logprobs: Tensor | None = None  # [B, T] trainer log-probs of the sampling weights
    ref_logprobs: Tensor | None = None  # [B, T]
    values: Tensor | None = None  # [B, T] critic values at sampling time
    baseline_scores: Tensor | None = None  # [B]
    token_rewards: Tensor | None = None  # [B, T]
    advantages: Tensor | None = None  # [B, T]
    returns: Tensor | None = None  # [B, T]
    # multi-turn episodes (sources/ of environments): observation and template tokens between the
    # policy's turns sit in the response with response_mask 0 but are attended to
    response_attention: Tensor | None = None  # [B, T] long, 1 on every real response token; None: response_mask
    turn_rewards: Tensor | None = None  # [B, T] rewards the source placed on tokens (a turn's on its last token)
    # rollout.interrupt: generation switched weights mid-sample; the version that sampled each token
    token_versions: Tensor | None = None  # [B, T] long
    # rollout.keep_sampling_mask: each sampled token's kept set under top-k/top-p/min-p (the ids,
    # −1 padded; a position of −1 only means the whole vocabulary), the support the trainer
    # renormalises its log-probs over
    sampling_mask: Tensor | None = None  # [B, T, K] int32
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        """``[B, P + T]`` prompt ‖ response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def response_attention_mask(self) -> Tensor:
        """``[B, T]`` long: the response tokens attended to (sampled, and in episodes also the
        environment's tokens between turns)."""
        return self.response_mask.long() if self.response_attention is None else self.response_attention.long()

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_attention_mask], dim=1)

    @property
    def completion_ids(self) -> list[list[int]]:
        lengths = self.response_mask.sum(-1).long().tolist()
        return [row[:n] for row, n in zip(self.response_ids.tolist(), lengths, strict=True)]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with every tensor field on ``device`` (itself when they all are)."""
        tensors = {
            item.name: value
            for item in dataclasses.fields(self)
            if isinstance(value := getattr(self, item.name), Tensor) and value.device != torch.device(device)
        }
        if not tensors:
            return self
        return dataclasses.replace(self, **{name: value.to(device) for name, value in tensors.items()})

    def select(self, index: Tensor | Sequence[int]) -> RolloutBatch:
        """The samples at ``index`` (a ``[B']`` long tensor or list), every field cut alike."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Tensor):
                picked[item.name] = value[index]
            elif isinstance(value, list):
                picked[item.name] = [value[i] for i in index.tolist()]
            elif item.name == "columns":
                picked[item.name] = {k: [v[i] for i in index.tolist()] for k, v in value.items()}
            else:
                picked[item.name] = value
        return RolloutBatch(**picked)

    def response_widths(self) -> Tensor:
        """``[B]`` each response's width up to its last attended token (environment turns included)."""
        attended = self.response_attention_mask
        if not attended.numel():
            return torch.zeros(len(self), dtype=torch.long, device=attended.device)
        positions = torch.arange(1, attended.shape[1] + 1, device=attended.device)
        return (attended * positions).amax(1)

    def lengths(self) -> tuple[list[int], list[int]]:
        """(prompt tokens, response width up to the last attended token) of every sample: the
        positions a pass over it alone would take (train/micro_batches.py)."""
        return self.prompt_mask.sum(1).tolist(), self.response_widths().tolist()

    def trimmed(self) -> RolloutBatch:
        """The same samples without the padding columns no sample uses (left of the longest
        prompt, right of the longest response): a subset of a batch is often narrower."""
        prompt_start = int((self.prompt_mask.sum(0) > 0).long().argmax()) if len(self) else 0
        # past the last attended token of any row (an episode's mask has gaps: its environment turns)
        response_width = max(int(self.response_widths().max()) if len(self) else 0, 1)
        if prompt_start == 0 and response_width == self.response_ids.shape[1]:
            return self
        picked: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Tensor) and item.name in ("prompt_ids", "prompt_mask"):
                value = value[:, prompt_start:]
            elif isinstance(value, Tensor) and value.dim() >= 2 and item.name != "reward_components":
                value = value[:, :response_width]
            picked[item.name] = value
        return RolloutBatch(**picked)


def from_rollouts(
    rollouts: Rollouts, tokenizer: Any, rows: Sequence[Mapping[str, Any]], prompt_column: str, group_offset: int = 0
) -> RolloutBatch:
    """Wrap an engine's output with the text and dataset columns of its rows (one row per prompt)."""
    n = len(rollouts) // len(rows)
    completions = tokenizer.batch_decode(
        [
            ids[:length]
            for ids, length in zip(rollouts.response_ids.tolist(), rollouts.response_lengths.tolist(), strict=True)
        ],
        skip_special_tokens=True,
    )
    names = [key for key in rows[0] if key not in RESERVED_COLUMNS and key != prompt_column] if rows else []
    columns = {key: [row.get(key) for row in rows for _ in range(n)] for key in names}
    return RolloutBatch(
        prompt_ids=rollouts.prompt_ids,
        prompt_mask=rollouts.prompt_mask,
        response_ids=rollouts.response_ids,
        response_mask=rollouts.response_mask,
        engine_logprobs=rollouts.logprobs,
        group_ids=rollouts.group_ids + group_offset,
        truncated=rollouts.truncated,
        policy_version=rollouts.policy_version,
        token_versions=rollouts.extras.get("token_versions"),
        sampling_mask=rollouts.extras.get("sampling_mask"),
        prompts=[row[prompt_column] for row in rows for _ in range(n)],
        completions=completions,
        columns=columns,
    )


def concat(batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch from several generation rounds (dynamic sampling); pads prompts on the left
    and responses on the right to the widest one."""
    if len(batches) == 1:
        return batches[0]
    prompt_width = max(b.prompt_ids.shape[1] for b in batches)
    response_width = max(b.response_ids.shape[1] for b in batches)

    def pad(t: Tensor, width: int, value: float, left: bool) -> Tensor:
        missing = width - t.shape[1]
        if missing == 0:
            return t
        filler = torch.full((t.shape[0], missing, *t.shape[2:]), value, dtype=t.dtype)
        return torch.cat([filler, t] if left else [t, filler], dim=1)

    merged: dict[str, Any] = {}
    for item in dataclasses.fields(RolloutBatch):
        values = [getattr(b, item.name) for b in batches]
        if item.name in ("prompt_ids", "prompt_mask"):
            fill = pad_id if item.name == "prompt_ids" else 0
            merged[item.name] = torch.cat([pad(v, prompt_width, fill, True) for v in values])
        elif all(isinstance(v, Tensor) for v in values):
            if values[0].dim() == 2 and item.name != "reward_components":
                fill = pad_id if item.name == "response_ids" else 0
                merged[item.name] = torch.cat([pad(v, response_width, fill, False) for v in values])
            elif item.name == "sampling_mask":  # [B, T, K]: the widest kept set too
                kept = max(v.shape[2] for v in values)
                values = [torch.nn.functional.pad(v, (0, kept - v.shape[2]), value=-1) for v in values]
                merged[item.name] = torch.cat([pad(v, response_width, -1, False) for v in values])
            else:
                merged[item.name] = torch.cat(values)
        elif all(isinstance(v, list) for v in values):
            merged[item.name] = [x for v in values for x in v]
        elif item.name == "columns":
            merged[item.name] = {k: [x for v in values for x in v[k]] for k in values[0]}
        elif all(v is None for v in values):
            merged[item.name] = None
        elif item.name == "extras":
            merged[item.name] = {}
        else:
            raise ValueError(f"cannot merge field {item.name!r}: set in some rounds and not in others")
    return RolloutBatch(**merged)
