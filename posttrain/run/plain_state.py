"""A checkpoint's training state as tensors and JSON values: reading one never runs code.

A pickle is a program: unpickling a crafted ``training_state.pt`` (``torch.load`` of old)
runs whatever its author wrote (and its checksum, written by the same author, proves nothing).
So the state a loop hands to a checkpoint is split into ``<stem>.safetensors`` (every tensor,
under a generated name) and ``<stem>.json`` (the rest, with each tensor replaced by a reference
to its name). Both formats are data only.

What a state may hold: tensors, ``str``, ``int``, ``float``, ``bool``, ``None``, lists, tuples
and dicts (keys ``str``, ``int``, ``float``, ``bool``, ``None`` or tuples of those — optimizer
states are keyed by parameter index); NumPy scalars are stored as the Python number they hold.
Tuples and non-string keys are tagged in the JSON so they come back as they went in (Python's
``random.setstate`` needs its tuple, ``Optimizer.load_state_dict`` its integer keys). Anything
else — a NumPy array, a set, an object — is refused when saving, naming its place in the state,
so a stateful reward's ``state_dict()`` is held to the same rule (docs/rewards.md).

Covers: a file written by anyone, read on any machine. Does not cover: the model weights
(safetensors, loaded by the caller) or a checkpoint's values being sensible for the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from posttrain.errors import PosttrainError

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"
TAGS = (TENSOR, TUPLE, ITEMS)
SCALARS = (str, int, float, bool, type(None))


class PlainStateError(PosttrainError, ValueError):
    """A state that cannot be written or read as tensors and JSON values; the message names its place."""


def save_plain_state(state: dict[str, Any], folder: str | Path, stem: str) -> list[Path]:
    """Write ``state`` as ``<stem>.json`` and ``<stem>.safetensors`` in ``folder``; return both paths."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    folder = Path(folder)
    json_path, tensor_path = folder / f"{stem}.json", folder / f"{stem}.safetensors"
    json_path.write_text(json.dumps(tree), encoding="utf-8")
    save_file(tensors, str(tensor_path))
    return [json_path, tensor_path]


def load_plain_state(folder: str | Path, stem: str) -> dict[str, Any]:
    """Read what :func:`save_plain_state` wrote; a file that does not decode is an error naming it."""
    folder = Path(folder)
    json_path, tensor_path = folder / f"{stem}.json", folder / f"{stem}.safetensors"
    try:
        tree = json.loads(json_path.read_text(encoding="utf-8"))
        tensors = load_file(str(tensor_path), device="cpu")
    except Exception as error:  # OSError, JSON's ValueError, safetensors' own SafetensorError
        raise PlainStateError(f"{json_path.name} / {tensor_path.name} in {folder} cannot be read: {error}") from None
    return _decode(tree, tensors, str(json_path))


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = _own_storage(value.detach().cpu(), tensors)
        return {TENSOR: name}
    if isinstance(value, np.generic) and not isinstance(value, np.ndarray):
        value = value.item()  # a NumPy scalar is a number; the array type stays refused below
    if type(value) in SCALARS:
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]
        return {TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(type(key) is str and key not in TAGS for key in value):
            return {key: _encode(item, tensors, f"{where}/{key}") for key, item in value.items()}
        items = value.items()
        return {ITEMS: [[_encode_key(key, where), _encode(item, tensors, f"{where}/{key}")] for key, item in items]}
    raise PlainStateError(
        f"checkpoint state {where!r} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds "
        "tensors and JSON values only (str, int, float, bool, None, lists, tuples, dicts) so that loading it never "
        "runs code. Return it as one of those from state_dict() (e.g. an array as a tensor or a list)."
    )


def _own_storage(tensor: torch.Tensor, saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """``tensor`` itself when it is the whole of a storage no saved tensor uses (no copy: an
    optimizer's state is as large as the model twice over), else a copy: safetensors refuses
    tensors that share memory (views, tied weights)."""
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    pointer = tensor.untyped_storage().data_ptr()
    if not whole or any(other.untyped_storage().data_ptr() == pointer for other in saved.values()):
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _encode_key(key: Any, where: str) -> Any:
    if type(key) in SCALARS:
        return key
    if type(key) is tuple:
        return {TUPLE: [_encode_key(part, where) for part in key]}
    raise PlainStateError(f"checkpoint state {where!r} has a key of type {type(key).__name__}: {key!r}")


def _decode(node: Any, tensors: dict[str, torch.Tensor], source: str) -> Any:
    if type(node) in SCALARS:
        return node
    if isinstance(node, list):
        return [_decode(item, tensors, source) for item in node]
    if not isinstance(node, dict):
        raise PlainStateError(f"{source} holds a value of type {type(node).__name__}, which no save writes")
    if TENSOR in node:
        if node[TENSOR] not in tensors:
            raise PlainStateError(f"{source} refers to tensor {node[TENSOR]!r}, which its .safetensors lacks")
        return tensors[node[TENSOR]]
    if TUPLE in node:
        return tuple(_decode(item, tensors, source) for item in node[TUPLE])
    if ITEMS in node:
        return {_hashable(_decode(k, tensors, source), source): _decode(v, tensors, source) for k, v in node[ITEMS]}
    return {key: _decode(item, tensors, source) for key, item in node.items()}


def _hashable(key: Any, source: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise PlainStateError(f"{source} has a dict key that is not a value: {key!r}") from None
    return key
