"""Keys and values kept from one ``generate`` call for the next: a multi-turn episode's next turn.

Turn t + 1 of an episode is prompted with everything turn t saw — the system message, the task,
the turns so far — then the policy's reply and what the environment answered. Encoding all of it
again costs a prefill of the whole conversation every turn; the keys and values of everything
but the environment's answer were computed when turn t ran. The engine keeps them when the
caller says more turns may follow (``SamplingParams.keep_cache``) and the next call's prompts
begin with them: each new row takes the kept row it shares the longest prefix with, and only
its tokens after that prefix go through the layers. This is the prefix caching that vLLM and
SGLang give verl's and SkyRL's agent loops, kept to one call back.

Reuse is exact up to float rounding: a kept key was computed by a decoding step, the one it
replaces would come from a prefill of the same tokens under the same weights. Kept rows are
valid only under the weights that computed them — the engine drops them when the weights
changed (an optimizer step, a weight update), so a resumed run, whose step starts with nothing
kept, samples what a straight one samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# reuse only when it spares at least this many tokens in all: below it the copies cost about what they save
MIN_REUSED = 64
MATCH_CHUNK = 64  # new rows compared against the kept ones at a time ([chunk, kept, width] booleans)


@dataclass
class Reuse:
    """What a prefill takes from kept rows: row b's first ``lengths[b]`` tokens come with their
    keys and values ``keys[b], values[b] [layers, kv heads, ≥ lengths[b], head dim]`` (None
    where ``lengths[b]`` is 0)."""

    lengths: Tensor
    keys: list[Tensor | None]
    values: list[Tensor | None]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class KeptRows:
    """The rows of one call: each row's keys and values and, once the call is over, its tokens
    (the prompt's, then the sampled ones its cache holds); ``weights`` marks the weights that
    computed them."""

    weights: object
    rows: list[tuple[int, int]] = field(default_factory=list)  # (output row, tokens decoded)
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    tokens: list[Tensor] = field(default_factory=list)

    def add(self, row: int, decoded: int, keys: Tensor, values: Tensor) -> None:
        """Output ``row``'s keys and values ``[layers, kv heads, n, D]``: its prompt's real
        tokens and the first ``decoded`` tokens it sampled."""
        self.rows.append((row, decoded))
        self.keys.append(keys)
        self.values.append(values)

    def name_tokens(self, prompt_ids: Tensor, prompt_mask: Tensor, n: int, sampled: Tensor) -> None:
        """Each kept row's tokens, from the call's left-padded prompts (``n`` rows each) and
        its ``sampled [B, steps]`` tokens."""
        self.tokens = [
            torch.cat([prompt_ids[row // n][prompt_mask[row // n].bool()], sampled[row, :decoded]])
            for row, decoded in self.rows
        ]

    def reuse_for(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Reuse | None:
        """Each left-padded prompt's longest prefix among the kept rows (one token of its own
        always left to encode); None when that spares fewer than :data:`MIN_REUSED` tokens."""
        if not self.tokens:
            return None
        lengths = prompt_mask.long().sum(-1)
        prompts = [ids[ids.numel() - int(n) :] for ids, n in zip(prompt_ids, lengths, strict=True)]
        best, source = longest_common_prefixes(prompts, self.tokens)
        best = torch.minimum(best, lengths - 1).clamp_(min=0)
        if int(best.sum()) < MIN_REUSED:
            return None
        chosen = [int(s) if int(n) else None for s, n in zip(source, best, strict=True)]
        return Reuse(
            best,
            [None if s is None else self.keys[s] for s in chosen],
            [None if s is None else self.values[s] for s in chosen],
        )


def longest_common_prefixes(prompts: list[Tensor], kept: list[Tensor]) -> tuple[Tensor, Tensor]:
    """For each prompt, the length of the longest prefix it shares with any kept sequence, and
    which one: ``([U], [U])`` long."""
    width = min(max(t.numel() for t in prompts), max(t.numel() for t in kept))
    table = torch.full((len(kept), width), -1, dtype=torch.long)
    for i, tokens in enumerate(kept):
        table[i, : min(tokens.numel(), width)] = tokens[:width]
    best, source = [], []
    for start in range(0, len(prompts), MATCH_CHUNK):
        chunk = prompts[start : start + MATCH_CHUNK]
        rows = torch.full((len(chunk), width), -2, dtype=torch.long)
        for i, tokens in enumerate(chunk):
            rows[i, : min(tokens.numel(), width)] = tokens[:width].cpu()
        alike = (rows[:, None] == table[None]).cumprod(-1).sum(-1)  # [chunk, kept]: prefix lengths
        length, index = alike.max(-1)
        best.append(length)
        source.append(index)
    return torch.cat(best), torch.cat(source)
