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


NEVER, MAYBE, CERTAIN = 0, 1, 2  # what a token can do to a stop string (EndingTokens)


class EndingTokens:
    """What each token id can do to a stop string: a per-tokenizer cache, filled as ids appear.

    A stop string is completed by the token that brings its last character. That token's own
    text (decoded alone) holds the character, unless the text is not what the token adds in
    context: a partial UTF-8 sequence (byte-level BPE, byte fallback: decoded alone it shows
    U+FFFD) or leading whitespace that a tokenizer drops from a lone token (SentencePiece's
    "▁"). So a token whose lone text is free of U+FFFD and of every stop string's last
    character can NEVER end a response; one whose lone text holds a whole stop string (with no
    whitespace in it, which decoding may respace) is CERTAIN to; any other MAYBE does, which
    only the decoded text can tell. A stop string that ends in whitespace makes every token
    MAYBE (no shortcut)."""

    _shared: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()  # tokenizer → {stops: cache}

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.last_chars = {s[-1] for s in stop_strings}
        self.everything = any(c.isspace() for c in self.last_chars)
        self.whole = [s for s in stop_strings if not any(c.isspace() for c in s)]
        self.known: dict[int, int] = {}

    @classmethod
    def of(cls, tokenizer: Any, stop_strings: tuple[str, ...]) -> EndingTokens:
        try:
            per_tokenizer = cls._shared.setdefault(tokenizer, {})
        except TypeError:  # an object that takes no weak reference or no hash: a cache of this call's own
            return cls(tokenizer, stop_strings)
        key = frozenset(stop_strings)
        if key not in per_tokenizer:
            per_tokenizer[key] = cls(tokenizer, stop_strings)
        return per_tokenizer[key]

    def kinds(self, rows: list[list[int]]) -> list[list[int]]:
        """NEVER, MAYBE or CERTAIN for every token of each row."""
        if self.everything:
            return [[MAYBE] * len(row) for row in rows]
        unknown = sorted({t for row in rows for t in row} - self.known.keys())
        if unknown:
            texts = self.tokenizer.batch_decode([[t] for t in unknown], skip_special_tokens=True)
            for token, text in zip(unknown, texts, strict=True):
                self.known[token] = self._kind(text)
        return [[self.known[t] for t in row] for row in rows]

    def _kind(self, text: str) -> int:
        if "\ufffd" in text:
            return MAYBE
        if any(s in text for s in self.whole):
            return CERTAIN
        return MAYBE if any(c in text for c in self.last_chars) else NEVER


class StopStrings:
    """Finds decoded stop strings at the end of each response as its tokens arrive.

    Only the tail of a response is decoded: a stop string that a new token completed lies
    within its last few tokens, and any earlier occurrence would already have ended the
    response. The tail is ``4 × (longest stop string) + 4`` tokens, enough for a string of that
    many characters of up to 4 bytes each with one token per byte (byte-level BPE at its
    worst). Text is decoded with ``skip_special_tokens=True``, as vLLM matches. Only tails that
    end at a token that MAYBE completes a stop string are decoded (:class:`EndingTokens`);
    ``prefilter=False`` decodes every live row's, the reference the tests compare with.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], batch: int, prefilter: bool = True) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.window = 4 * max(len(s) for s in stop_strings) + 4
        self.histories: list[list[int]] = [[] for _ in range(batch)]
        self.ending = EndingTokens.of(tokenizer, self.stop_strings) if prefilter else None

    def _holds_stop(self, text: str) -> bool:
        return any(s in text for s in self.stop_strings)

    def update(self, tokens: Tensor, rows: Tensor, alive: Tensor) -> Tensor:
        """Append ``tokens [b]`` to the responses ``rows [b]`` that are ``alive [b]``; return
        ``[b]`` bool, True where a stop string now ends the response."""
        live = torch.nonzero(alive).flatten().tolist()
        new_tokens, row_ids = tokens.tolist(), rows.tolist()
        histories = [self.histories[row_ids[i]] for i in live]
        for i, history in zip(live, histories, strict=True):
            history.append(new_tokens[i])
        hit = torch.zeros(alive.shape, dtype=torch.bool)
        kinds = (
            [MAYBE] * len(live)
            if self.ending is None
            else [k for (k,) in self.ending.kinds([[new_tokens[i]] for i in live])]
        )
        unsure = [(i, history) for i, history, kind in zip(live, histories, kinds, strict=True) if kind == MAYBE]
        texts = self._decode([history[-self.window :] for _, history in unsure])
        for (i, _), text in zip(unsure, texts, strict=True):
            hit[i] = self._holds_stop(text)
        for i, kind in zip(live, kinds, strict=True):
            hit[i] |= kind == CERTAIN
        return hit.to(alive.device)

    def first_hits(self, tokens: Tensor, alive: Tensor) -> Tensor:
        """Append ``tokens [b, n]`` (n steps at once) to the responses (rows) that are
        ``alive [b]``; return ``[b]`` long: the first of the n steps whose token completed a
        stop string, −1 where none did. For a decoder that looks every few steps: a row's tails
        are decoded only up to its first CERTAIN token, and only where a token MAYBE ends it."""
        first = torch.full((tokens.shape[0],), -1, dtype=torch.long)
        live, columns = torch.nonzero(alive).flatten().tolist(), tokens.tolist()
        for i in live:
            self.histories[i].extend(columns[i])
        if self.ending is None:
            return self._first_hits_decoding_all(first, live, tokens.shape[1])
        # each row's steps that may end it, up to and including the first that surely does
        candidates: dict[int, list[tuple[int, int]]] = {}
        for i, kinds in zip(live, self.ending.kinds([columns[i] for i in live]), strict=True):
            steps = [(k, kind) for k, kind in enumerate(kinds) if kind != NEVER]
            sure = next((n for n, (_, kind) in enumerate(steps) if kind == CERTAIN), len(steps))
            if steps:
                candidates[i] = steps[: sure + 1]
        start = {i: len(self.histories[i]) - tokens.shape[1] for i in candidates}  # where step 0's token is
        maybe = {i: [k for k, kind in steps if kind == MAYBE] for i, steps in candidates.items()}
        # a row with several MAYBE steps is screened first: one tail spanning them all
        screened = [i for i in candidates if len(maybe[i]) > 1]
        spans = [self._tail(i, start[i] + maybe[i][-1], maybe[i][-1] - maybe[i][0]) for i in screened]
        ended = {i for i, text in zip(screened, self._decode(spans), strict=True) if self._holds_stop(text)}
        unsure = [(i, k) for i in candidates if len(maybe[i]) == 1 or i in ended for k in maybe[i]]
        texts = dict(zip(unsure, self._decode([self._tail(i, start[i] + k) for i, k in unsure]), strict=True))
        for i, steps in candidates.items():
            found = (k for k, kind in steps if kind == CERTAIN or ((i, k) in texts and self._holds_stop(texts[i, k])))
            first[i] = next(found, -1)
        return first

    def _tail(self, row: int, last: int, extra: int = 0) -> list[int]:
        """Row ``row``'s last ``window + extra`` tokens up to and including position ``last``."""
        return self.histories[row][: last + 1][-(self.window + extra) :]

    def _decode(self, tails: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(tails, skip_special_tokens=True) if tails else []

    def _first_hits_decoding_all(self, first: Tensor, live: list[int], steps: int) -> Tensor:
        """The reference: every live row's last ``window + n − 1`` tokens decoded once, and a row
        whose text holds a stop string decoded again step by step to find where it ended."""
        texts = self._decode([self.histories[i][-(self.window + steps - 1) :] for i in live])
        for i, text in zip(live, texts, strict=True):
            if not self._holds_stop(text):
                continue
            start = len(self.histories[i]) - steps
            prefixes = self._decode([self._tail(i, start + k) for k in range(steps)])
            first[i] = next((k for k, t in enumerate(prefixes) if self._holds_stop(t)), -1)
        return first
