"""Ending responses: stop token ids and decoded stop strings, checked as tokens arrive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def stop_id_tensor(eos_id: int | None, stop_token_ids: Sequence[int]) -> Tensor | None:
    """The ids that end a response (EOS and the caller's), ``[S]`` long; None when there are none."""
    ids = sorted({eos_id, *stop_token_ids} - {None})
    return torch.tensor(ids, dtype=torch.long) if ids else None


class StopStrings:
    """Finds decoded stop strings at the end of each response as its tokens arrive.

    Only the tail of a response is decoded each step: a stop string that the newest token
    completed lies within its last few tokens, and any earlier occurrence would already have
    ended the response. The tail is ``4 × (longest stop string) + 4`` tokens, enough for a
    string of that many characters of up to 4 bytes each with one token per byte (byte-level
    BPE at its worst). Text is decoded with ``skip_special_tokens=True``, as vLLM matches.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], batch: int) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.window = 4 * max(len(s) for s in stop_strings) + 4
        self.histories: list[list[int]] = [[] for _ in range(batch)]

    def update(self, tokens: Tensor, rows: Tensor, alive: Tensor) -> Tensor:
        """Append ``tokens [b]`` to the responses ``rows [b]`` that are ``alive [b]``; return
        ``[b]`` bool, True where a stop string now ends the response."""
        live = torch.nonzero(alive).flatten().tolist()
        new_tokens, row_ids = tokens.tolist(), rows.tolist()
        tails = []
        for i in live:
            history = self.histories[row_ids[i]]
            history.append(new_tokens[i])
            tails.append(history[-self.window :])
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        hit = torch.zeros(alive.shape, dtype=torch.bool)
        for i, text in zip(live, texts, strict=True):
            hit[i] = any(s in text for s in self.stop_strings)
        return hit.to(alive.device)

    def first_hits(self, tokens: Tensor, alive: Tensor) -> Tensor:
        """Append ``tokens [b, n]`` (n steps at once) to the responses (rows) that are
        ``alive [b]``; return ``[b]`` long: the first of the n steps whose token completed a
        stop string, −1 where none did. For a decoder that looks every few steps: the last
        ``window + n − 1`` tokens are decoded once per row, and only a row whose text holds a
        stop string is decoded again step by step to find where it ended."""
        steps = tokens.shape[1]
        first = torch.full((tokens.shape[0],), -1, dtype=torch.long)
        live, columns = torch.nonzero(alive).flatten().tolist(), tokens.tolist()
        for i in live:
            self.histories[i].extend(columns[i])
        texts = self.tokenizer.batch_decode(
            [self.histories[i][-(self.window + steps - 1) :] for i in live], skip_special_tokens=True
        )
        for i, text in zip(live, texts, strict=True):
            if not any(s in text for s in self.stop_strings):
                continue
            history = self.histories[i]
            ends = range(len(history) - steps + 1, len(history) + 1)
            prefixes = self.tokenizer.batch_decode(
                [history[:end][-self.window :] for end in ends], skip_special_tokens=True
            )
            first[i] = next((k for k, t in enumerate(prefixes) if any(s in t for s in self.stop_strings)), -1)
        return first
