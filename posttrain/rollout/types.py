"""What a rollout engine takes and gives back.

Every engine (the native one for Llama/Qwen2 weights, the transformers fallback, vLLM later)
implements :class:`RolloutEngine`, so the RL loop switches engines with one config key and an
engine can later move to another process or machine: its inputs and outputs are plain
tensors and lists, never model objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Defaults are plain ancestral sampling at temperature 1."""

    n: int = 1
    """Samples per prompt (the group). Outputs are prompt-major: prompt 0's n samples first."""
    max_new_tokens: int = 64
    """Hard cap on generated tokens; a response that hits it finishes with reason "length"."""
    temperature: float = 1.0
    """Logits are divided by this before sampling. Must be > 0 unless ``greedy``."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p × the top token's probability; 0 = off."""
    greedy: bool = False
    """Take the argmax (evaluation, ReMax baselines); temperature and truncation are ignored."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response, in addition to the engine's EOS id. The stop token is
    part of the response (the policy chose it, so it is trained on)."""
    stop_strings: tuple[str, ...] = ()
    """Decoded substrings that end a response; the token completing one is kept."""
    seed: int | None = None
    """Seeds this call's sampling; the same seed, prompts and weights give the same tokens."""
    sampling_mask: bool = False
    """Also return each sampled token's kept set under top-k/top-p/min-p
    (``Rollouts.extras["sampling_mask"]``), so the trainer can renormalise over it."""
    keep_cache: bool = False
    """The next call may continue these rows (a multi-turn episode's next turn): an engine that
    can keeps their keys and values until then, and encodes only what the next prompts add
    (rollout/turn_cache.py). Changes no result beyond float rounding."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got n={self.n}, max_new_tokens={self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (or set greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p < 1:
            raise ValueError(
                f"need 0 < top_p <= 1, top_k >= 0, 0 <= min_p < 1; got {self.top_p}, {self.top_k}, {self.min_p}"
            )


@dataclass
class Rollouts:
    """A batch of sampled responses, B = number of prompts × n, prompt-major.

    Log-probs convention: ``logprobs[i, t]`` is the behaviour log-prob of the sampled token, that
    of the distribution that actually sampled it — log softmax(logits / temperature) over the
    tokens top-k/top-p/min-p kept, renormalised over them (vLLM's ``processed_logprobs``); with
    no filter the whole tempered distribution, which is what the trainer recomputes. Greedy
    decoding reports temperature-1 log-probs. With ``SamplingParams.sampling_mask`` and a
    filter on, ``extras["sampling_mask"] [B, T, K]`` int32 holds each token's kept ids (−1
    padded; a row of −1 means the whole vocabulary).
    """

    prompt_ids: Tensor  # [B, P] long, left-padded with the pad id
    prompt_mask: Tensor  # [B, P] long, 1 on real prompt tokens
    response_ids: Tensor  # [B, T] long, right-padded with the pad id
    response_mask: Tensor  # [B, T] float, 1 on generated tokens (stop token included)
    logprobs: Tensor  # [B, T] float32, engine log-probs of the sampled tokens; 0 on padding
    finish_reasons: list[str]  # [B] "stop" or "length"
    group_ids: Tensor  # [B] long, index of the prompt in the generate() call
    policy_version: Tensor  # [B] long, the weights version that sampled each row
    extras: dict[str, Tensor] = field(default_factory=dict)  # engine-specific diagnostics

    @property
    def truncated(self) -> Tensor:
        """[B] bool: responses cut by ``max_new_tokens`` rather than ended by a stop."""
        return torch.tensor([reason == "length" for reason in self.finish_reasons], dtype=torch.bool)

    @property
    def response_lengths(self) -> Tensor:
        """[B] long: generated tokens per response."""
        return self.response_mask.sum(-1).long()

    def __len__(self) -> int:
        return self.response_ids.shape[0]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses with the current policy weights."""

    policy_version: int
    """Version of the weights the next call samples with (trainer updates so far)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        """Sample ``sampling.n`` responses for each prompt (token ids, no padding)."""
        ...

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Adopt new policy weights. ``state_dict=None`` means the engine shares the trainer's
        module by reference (colocated) and only needs to refresh what it derived from it;
        otherwise the tensors are copied in (another process, or vLLM)."""
        ...
