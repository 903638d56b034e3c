"""A sampled turn as the environment reads it: decoded with special tokens skipped, except the
tool-call format's markers, which stay where the model wrote them.

Mistral's ``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` and Llama 3.1's ``<|python_tag|>`` are
control tokens: decoding with special tokens skipped (as every turn is, so an EOS or a chat marker
never reaches a reward) dropped them, and every call read as a final answer. Decoding with special
tokens kept is no cure: a SentencePiece tokenizer then writes ``▁`` for every space, and the JSON
breaks. So the turn's ids are split at the markers' ids and each span between them is decoded with
special tokens skipped (the issue's "parse from token ids"); a marker the tokenizer writes as plain
text (Qwen's ``<tool_call>``, an added token that is not special) needs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def kept_markers(tokenizer: Any, markers: Sequence[str]) -> dict[int, str]:
    """The ``markers`` that are one token which decoding with special tokens skipped would drop,
    by id."""
    kept: dict[int, str] = {}
    unknown = getattr(tokenizer, "unk_token_id", None)
    added = getattr(tokenizer, "added_tokens_decoder", None)  # a method on mistral-common's backend
    added = added.values() if isinstance(added, Mapping) else ()
    special = {*tokenizer.all_special_tokens, *(str(token) for token in added if getattr(token, "special", False))}
    for marker in markers:
        if marker not in special:  # plain text to this tokenizer (looking it up would warn)
            continue
        token = tokenizer.convert_tokens_to_ids(marker)
        if not isinstance(token, int) or token < 0 or token == unknown:
            continue  # not one token of this tokenizer: written as text, read as text
        if tokenizer.decode([token], skip_special_tokens=True) == "":
            kept[token] = marker
    return kept


class MarkedTurn(str):
    """A turn's text that knows where its markers were sampled as tokens (``marker_starts``, the
    character offsets): the same characters written as plain text (a model quoting
    ``[TOOL_CALLS]`` in its answer) are no marker, and a format reads them as text."""

    marker_starts: tuple[int, ...] = ()


def decode_turn(tokenizer: Any, ids: Sequence[int], markers: Mapping[int, str]) -> str:
    """``ids`` decoded with special tokens skipped, but for the ``markers`` (by id), written as
    they are: a :class:`MarkedTurn` when there are any."""
    if not markers or not any(token in markers for token in ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    parts: list[str] = []
    starts: list[int] = []
    span: list[int] = []
    for token in ids:
        if token in markers:
            parts.append(tokenizer.decode(span, skip_special_tokens=True))
            starts.append(sum(map(len, parts)))
            parts.append(markers[token])
            span = []
        else:
            span.append(int(token))
    parts.append(tokenizer.decode(span, skip_special_tokens=True))
    turn = MarkedTurn("".join(parts))
    turn.marker_starts = tuple(starts)
    return turn


def first_marker(text: str, marker: str, start: int = 0) -> int:
    """Where ``marker`` first occurs in ``text`` from ``start`` (-1: nowhere), counting in a
    :class:`MarkedTurn` only the places a marker token was sampled."""
    sampled = getattr(text, "marker_starts", None)
    if sampled is None:
        return text.find(marker, start)
    return next((i for i in sampled if i >= start and text.startswith(marker, i)), -1)


def encode_turn(tokenizer: Any, text: str, markers: Mapping[int, str]) -> list[int]:
    """The ids of a turn the model writes as ``text`` (the inverse of :func:`decode_turn`): each
    of the ``markers`` (by id) where it occurs, the text between encoded as a turn's text is. A
    transformers tokenizer finds its special tokens in text itself; mistral-common's encodes their
    names as plain text, so a recorded Mistral call would train ``[``, ``TOOL``, ... instead of
    its ``[TOOL_CALLS]`` token."""
    by_name = {name: token for token, name in markers.items()}
    ids: list[int] = []
    position = 0
    while True:
        found = [(text.find(name, position), name) for name in by_name]
        found = [(start, name) for start, name in found if start >= 0]
        if not found:
            break
        start, name = min(found)
        ids += [*_encode(tokenizer, text[position:start]), by_name[name]]
        position = start + len(name)
    return ids + _encode(tokenizer, text[position:])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
