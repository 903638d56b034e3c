"""The KV cache keyword of a transformers forward, across releases."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor


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


def select_rows(cache: Any, rows: Tensor) -> None:
    """Keep the cache's batch rows ``rows`` (in order, repeats allowed), as transformers'
    ``batch_select_indices`` does, but gathered with ``index_select``.

    Why not that method: it indexes ``keys[rows]``, whose backward sums each row's gradient into
    its source with an accumulating ``index_put_``; on a CPU with several threads the order of
    those sums changes from one backward pass to the next when ``rows`` repeats (a prompt shared
    by a group), so the same seed trained different weights (tests/models/test_logprobs.py).
    ``index_select``'s backward (``index_add_``) sums in a fixed order. A layer type that keeps
    more than keys and values (one overriding the method) is left to its own method."""
    layers = getattr(cache, "layers", None)
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # a transformers before cache layers
        layers = None
    if layers is None:
        cache.batch_select_indices(rows)
        return
    for layer in layers:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(rows)
        elif torch.is_tensor(layer.keys) and layer.keys.numel() > 0:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
