"""The KV cache keyword of a transformers forward, across releases."""

from __future__ import annotations

import inspect
from typing import Any


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers ≥ 5.2x, where
    ``past_key_values`` is deprecated and warns) or ``past_key_values`` (earlier releases). A
    PEFT wrapper is looked through to the model it wraps."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    return {name: cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned, under either release's name (see :func:`cache_argument`)."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values
