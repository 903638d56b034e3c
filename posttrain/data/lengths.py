"""Rows longer than the model's context, found once the rows are tokenized.

The rule, the same in every command: a row whose tokens (for RL: the prompt's plus
``max_new_tokens``) exceed the model's ``max_position_embeddings`` is never truncated silently.
With ``data.on_bad_row: error`` (the default) the run stops, counting such rows and naming the
first ones; with ``skip`` they are left out with a printed count. Truncating would train on a
completion cut off mid-answer, or sample from a prompt missing its beginning; a model given
positions past its table fails deep inside attention or extrapolates without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from posttrain.data.loading import DataError

T = TypeVar("T")
_SHOWN = 5


def context_limit(model: Any) -> int | None:
    """The longest sequence the model's position table covers; None when it does not say."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def drop_overlong(
    items: Sequence[T],
    lengths: Sequence[int],
    limit: int | None,
    *,
    what: str,
    on_bad_row: str = "error",
    echo: Callable[[str], None] = print,
    limit_name: str = "the model's context",
) -> list[T]:
    """``items`` whose ``lengths`` fit in ``limit`` tokens; the others refused or skipped (see
    the module's rule). ``what`` names the items in the message ("rows of data.path"),
    ``limit_name`` the limit (a config key such as SFT's ``max_length``, when it is lower)."""
    if limit is None:
        return list(items)
    too_long = [index for index, length in enumerate(lengths) if length > limit]
    if not too_long:
        return list(items)
    shown = ", ".join(map(str, too_long[:_SHOWN])) + (", ..." if len(too_long) > _SHOWN else "")
    longest = max(lengths[index] for index in too_long)
    found = (
        f"{len(too_long)} of {len(items)} {what} are longer than {limit_name} of {limit} tokens "
        f"(rows {shown}; the longest has {longest})"
    )
    if on_bad_row == "error" or len(too_long) == len(items):
        raise_limit = f", raise {limit_name}" if limit_name != "the model's context" else ""
        raise DataError(f"{found}: shorten or remove them{raise_limit}, or set data.on_bad_row=skip to leave them out")
    echo(f"[data] skipped {found}")
    dropped = set(too_long)
    return [item for index, item in enumerate(items) if index not in dropped]
