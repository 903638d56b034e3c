"""Ending responses: stop token ids and decoded stop strings, checked as tokens arrive."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor


def stop_id_tensor(eos_id: int | None, stop_token_ids: Sequence[int]) -> Tensor | None:
    """The ids that end a response (EOS and the caller's), ``[S]`` long; None when there are none."""
    ids = sorted({eos_id, *stop_token_ids} - {None})
    return torch.tensor(ids, dtype=torch.long) if ids else None


class EndingTokens:
    """Which token ids could complete a stop string: a per-tokenizer cache, filled as ids appear.

    A stop string is completed by the token that brings its last character. That token's own
    text (decoded alone) holds the character, unless the text is not what the token adds in
    context: a partial UTF-8 sequence (byte-level BPE, byte fallback: decoded alone it shows
    U+FFFD) or leading whitespace that a tokenizer drops from a lone token (SentencePiece's
    "▁"). So a token whose lone text is free of U+FFFD and of every stop string's last
    character cannot end a response, and a row that drew only such tokens need not be decoded;
    when a stop string ends in whitespace every token counts as a candidate (no filter)."""

    _shared: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()  # tokenizer → {last chars: cache}

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.last_chars = {s[-1] for s in stop_strings}
        self.everything = any(c.isspace() for c in self.last_chars)
        self.known: dict[int, bool] = {}

    @classmethod
    def of(cls, tokenizer: Any, stop_strings: tuple[str, ...]) -> EndingTokens:
        try:
            per_tokenizer = cls._shared.setdefault(tokenizer, {})
        except TypeError:  # an object that takes no weak reference: a cache of this call's own
            return cls(tokenizer, stop_strings)
        key = frozenset(s[-1] for s in stop_strings)
        if key not in per_tokenizer:
            per_tokenizer[key] = cls(tokenizer, stop_strings)
        return per_tokenizer[key]

    def rows_that_may_end(self, rows: list[list[int]]) -> list[bool]:
        """For each row of new token ids, whether one of them could complete a stop string."""
        if self.everything:
            return [True] * len(rows)
        unknown = sorted({t for row in rows for t in row} - self.known.keys())
        if unknown:
            texts = self.tokenizer.batch_decode([[t] for t in unknown], skip_special_tokens=True)
            for token, text in zip(unknown, texts, strict=True):
                self.known[token] = "\ufffd" in text or any(c in text for c in self.last_chars)
        return [any(self.known[t] for t in row) for row in rows]


class StopStrings:
    """Finds decoded stop strings at the end of each response as its tokens arrive.

    Only the tail of a response is decoded each step: a stop string that the newest token
    completed lies within its last few tokens, and any earlier occurrence would already have
    ended the response. The tail is ``4 × (longest stop string) + 4`` tokens, enough for a
    string of that many characters of up to 4 bytes each with one token per byte (byte-level
    BPE at its worst). Text is decoded with ``skip_special_tokens=True``, as vLLM matches.
    Only rows whose new tokens could complete a stop string are decoded (:class:`EndingTokens`;
    ``prefilter=False`` decodes every live row, the reference the tests compare with).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], batch: int, prefilter: bool = True) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.window = 4 * max(len(s) for s in stop_strings) + 4
        self.histories: list[list[int]] = [[] for _ in range(batch)]
        self.ending = EndingTokens.of(tokenizer, self.stop_strings) if prefilter else None

    def _candidates(self, live: list[int], new: list[list[int]]) -> list[int]:
        """The live rows whose ``new`` tokens could complete a stop string."""
        if self.ending is None:
            return live
        return [i for i, may in zip(live, self.ending.rows_that_may_end(new), strict=True) if may]

    def update(self, tokens: Tensor, rows: Tensor, alive: Tensor) -> Tensor:
        """Append ``tokens [b]`` to the responses ``rows [b]`` that are ``alive [b]``; return
        ``[b]`` bool, True where a stop string now ends the response."""
        live = torch.nonzero(alive).flatten().tolist()
        new_tokens, row_ids = tokens.tolist(), rows.tolist()
        for i in live:
            self.histories[row_ids[i]].append(new_tokens[i])
        live = self._candidates(live, [[new_tokens[i]] for i in live])
        tails = [self.histories[row_ids[i]][-self.window :] for i in live]
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True) if tails else []
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
        live = self._candidates(live, [columns[i] for i in live])
        tails = [self.histories[i][-(self.window + steps - 1) :] for i in live]
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True) if tails else []
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
