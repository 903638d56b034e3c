"""What a checkpoint handed to a run must be before the run uses it, or touches anything of its own.

A checkpoint is anyone's folder, and its manifest's checksums are written by whoever wrote it: they
prove the files were not changed after the manifest, not that the manifest or the state say what a
save would have said. So every value a resume acts on is checked here, naming the file and field.

Covers: a manifest of the wrong shape; a manifest naming a file outside the checkpoint (``../``, an
absolute path, a link leading out), which would be read and hashed; a step other than the folder's
``step-N`` (a state saying ``step: -1`` made a resume truncate the run's metrics and retrain from
step 0 over its checkpoints; ``step: 10**12`` trained nothing and reported done); a training state
lacking a field its loop reads, or holding it as another type; a safetensors header that lies
(offsets past the file's end). Does not cover: values of the right type that are wrong for the run
(the config comparison in ``run_dir.py`` covers a changed model or data), nor what the weights say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from safetensors import safe_open

from posttrain.errors import PosttrainError

StateFields = Mapping[str, "type | tuple[type, ...]"]
"""A training state's fields a loop reads on resume and the type each must have."""

SAVED_FIELDS: StateFields = MappingProxyType({"step": int, "rng": dict})
"""What ``checkpoint.save_checkpoint`` writes into every training state, whatever the loop."""
NO_FIELDS: StateFields = MappingProxyType({})
RNG_STATES = ("python", "numpy", "torch")  # the generators whose states every save keeps

SHA256 = re.compile(r"^[0-9a-f]{64}$")
KINDS = {dict: "a mapping", int: "a whole number", float: "a number", list: "a list", str: "a string"}
KINDS[type(None)] = "null"


class CheckpointError(PosttrainError, RuntimeError):
    """A checkpoint that cannot be used; the message names the folder or file and why."""


def read_manifest(marker: Path) -> dict[str, Any]:
    """The manifest, checked for shape: ``{"step": N, "files": {name: {"size": int, "sha256": hex}}}``."""
    try:
        manifest = json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{marker} is unreadable ({error}); the checkpoint cannot be trusted") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{marker} is not a checkpoint manifest (no 'files' mapping); it cannot be trusted")
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not isinstance(digest, str) or not SHA256.match(digest):
            raise CheckpointError(
                f"{marker}: the entry of {name!r} is {entry!r:.120}, not a size and a SHA-256; it cannot be trusted"
            )
    return manifest


def file_inside(folder: Path, name: str, marker: Path) -> Path:
    """``folder / name``, refused when the name leads outside the checkpoint (read before anything else)."""
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts or "\\" in name:
        raise CheckpointError(f"{marker} names {name!r}, a file outside the checkpoint; it was not read")
    file = folder / relative
    if file.is_symlink() or not file.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{marker} names {name!r}, which leads outside the checkpoint; it was not read")
    return file


def checkpoint_step(folder: Path, manifest: Mapping[str, Any], marker: Path) -> int | None:
    """The step a checkpoint is at: its folder's ``step-N``, which the manifest must agree with
    (a folder given to ``--resume`` under another name: the manifest's step)."""
    named = re.match(r"^step-(\d+)$", folder.name)
    written = manifest.get("step")
    if named is None:
        return written if type(written) is int and written >= 0 else None
    step = int(named.group(1))
    if "step" in manifest and written != step:
        raise CheckpointError(
            f"{marker} says step {written!r:.40}, but the checkpoint is {folder.name}: it was changed after it was "
            "saved; resume from another checkpoint"
        )
    return step


def check_state(state: Any, where: str, step: int | None, fields: StateFields = NO_FIELDS) -> None:
    """A training state (its JSON as written, or decoded) holds every field its loop reads, each of
    its type, and the step its checkpoint is at."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where} holds {_kind(state)}, not a training state; resume from another checkpoint")
    for field, kind in {**SAVED_FIELDS, **fields}.items():
        if field not in state:
            raise CheckpointError(f"{where} lacks {field!r}, which every checkpoint of this run holds; it was altered")
        value = state[field]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) or not isinstance(value, kinds):  # JSON's true is not a step
            wanted = " or ".join(KINDS.get(k, k.__name__) for k in kinds)
            raise CheckpointError(
                f"{where}: {field!r} is {_kind(value)} ({value!r:.60}), where a save writes {wanted}; it was altered"
            )
    missing = [name for name in RNG_STATES if name not in state["rng"]]
    if missing:
        raise CheckpointError(f"{where}: 'rng' lacks the {', '.join(missing)} generator's state; it was altered")
    if step is not None and state["step"] != step:
        folder = f"step-{step}"
        raise CheckpointError(
            f"{where}: 'step' is {state['step']!r}, but the checkpoint is {folder}: the state was changed after it "
            "was saved; resume from another checkpoint"
        )


def check_tensor_file(file: Path) -> None:
    """A safetensors file whose header describes its data (offsets inside the file, shapes that fit)."""
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as error:  # safetensors' own SafetensorError, or an OSError
        raise CheckpointError(f"{file} cannot be read as safetensors ({error}); the checkpoint is unusable") from None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "true or false"
    return KINDS.get(type(value), f"a {type(value).__name__}")
