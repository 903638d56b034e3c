"""Checkpoints that survive a killed run and resume exactly.

Layout of ``<output_dir>/checkpoints/step-N/``: the model (and tokenizer) as a plain Hugging
Face folder — loadable by ``AutoModelForCausalLM.from_pretrained`` with no conversion — plus
``training_state.json`` + ``training_state.safetensors`` (optimizer, scheduler, RNG states, data
position, step, anything the loop adds: tensors and JSON values only, ``plain_state.py``, so
loading a checkpoint from anyone never runs code), ``config.yaml`` when given, and ``COMPLETE``:
a manifest of every file with its size and SHA-256, written last.

Covers: a process killed at any moment during a save (the checkpoint is built in a hidden
temporary folder and renamed into place only once complete, so a reader sees the whole
checkpoint or none of it); a file truncated or altered afterwards (the manifest no longer
matches and loading names the file); retention never deleting the newest complete
checkpoint; a crafted checkpoint (no pickle is unpickled: the manifest is written by whoever
wrote the checkpoint, so it proves integrity, not origin). Does not cover: a disk that lies
about fsync, or two processes writing the same run directory at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.distributed import is_sharded, load_full_weights, world
from posttrain.models.loading import quiet_progress_bars
from posttrain.rollout.projections import is_peft_model
from posttrain.run.checkpoint_checks import (  # CheckpointError re-exported: raised by both modules
    NO_FIELDS,
    CheckpointError,
    StateFields,
    check_state,
    check_tensor_file,
    checkpoint_step,
    file_inside,
    read_manifest,
)
from posttrain.run.plain_state import PlainStateError, load_plain_state, save_plain_state

MARKER = "COMPLETE"
STATE_STEM = "training_state"
LEGACY_STATE_FILE = "training_state.pt"  # a pickle, written before b5492cf's successor
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and every CUDA device) random states, as tensors and JSON values
    (NumPy's key array as an int64 tensor)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):  # the legacy pickle held get_state()'s tuple, which set_state takes as is
        key = numpy_state["state"]["key"]
        numpy_state = {**numpy_state, "state": {**numpy_state["state"], "key": np.asarray(key, dtype=np.uint32)}}
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any = None,
    training_state: dict[str, Any] | None = None,
    config_yaml: str | None = None,
    keep_last: int | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Checkpoint:
    """Write ``step-<step>`` atomically and return it; then prune to ``keep_last`` checkpoints.

    ``training_state`` holds whatever exact resume needs (optimizer / scheduler state dicts,
    data position, controller states, ...); RNG states are added here. ``weights``: the model's
    whole state dict when the module holds only shards of it (``distributed.py``, FSDP2).
    """
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    _clear_stale_staging(root)
    staging = root / f".staging-step-{step}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        with quiet_progress_bars():
            model.save_pretrained(staging, safe_serialization=True, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        save_plain_state({"step": step, "rng": capture_rng_state(), **(training_state or {})}, staging, STATE_STEM)
        if config_yaml is not None:
            (staging / "config.yaml").write_text(config_yaml, encoding="utf-8")
        _write_manifest(staging, step)
        if final.exists():  # re-saving a step (e.g. after a resume) replaces it whole
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if keep_last is not None:
        prune_checkpoints(output_dir, keep_last)
    return Checkpoint(final, step)


def list_checkpoints(output_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints (those with a manifest), oldest first. Contents are not verified here."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            found.append(Checkpoint(child, int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(output_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint that verifies (``--resume auto``); broken newer ones are skipped."""
    for checkpoint in reversed(list_checkpoints(output_dir)):
        try:
            verify_checkpoint(checkpoint.path)
        except CheckpointError:
            continue
        return checkpoint
    return None


def prune_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` (at least 1) complete checkpoints; return them."""
    doomed = [c.path for c in list_checkpoints(output_dir)[: -max(1, keep_last)]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _clear_stale_staging(root: Path) -> None:
    """Staging folders of other processes are leftovers of killed saves (one writer per run)."""
    for path in root.iterdir():
        if path.name.startswith(".staging-") and not path.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(path, ignore_errors=True)


def verify_checkpoint(path: str | Path, fields: StateFields = NO_FIELDS) -> dict[str, Any]:
    """Check the manifest against the files, and what a resume reads against what a save writes
    (``checkpoint_checks.py``; ``fields``: the loop's own state fields and their types); return the
    manifest, or raise naming the first problem."""
    path = Path(path)
    marker = path / MARKER
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise CheckpointError(
            f"{path} {what}: a checkpoint is a folder <output_dir>/checkpoints/step-N (or use --resume auto)"
        )
    if not marker.is_file():
        if checkpoint_root(path).is_dir():
            raise CheckpointError(
                f"{path} is a run folder, not a checkpoint: give one of {checkpoint_root(path)}/step-N, or "
                f"--resume auto with output_dir={path}"
            )
        raise CheckpointError(f"{path} is not a complete checkpoint: {MARKER} is missing (the save was interrupted)")
    manifest = read_manifest(marker)
    step = checkpoint_step(path, manifest, marker)
    for name, expected in manifest["files"].items():
        file = file_inside(path, name, marker)
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != expected["size"]:
            raise CheckpointError(
                f"checkpoint file {file} has {file.stat().st_size} bytes, expected {expected['size']} (truncated?)"
            )
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {file} does not match its checksum (corrupted)")
        if file.suffix == ".safetensors":
            check_tensor_file(file)
    state = path / f"{STATE_STEM}.json"
    if state.is_file():  # the written form (a legacy pickle is checked once read: load_training_state)
        try:
            check_state(json.loads(state.read_text(encoding="utf-8")), str(state), step, fields)
        except (ValueError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{state} cannot be read: {error}") from None
    return manifest


def load_training_state(
    path: str | Path, fields: StateFields = NO_FIELDS, *, restore_rng: bool = True
) -> dict[str, Any]:
    """Verify the checkpoint and return its training state, which holds ``fields`` (the loop's,
    besides the step and RNG states every save writes); restore the RNG states by default.

    The model weights are loaded by the caller with ``from_pretrained(path)`` (it may need a
    dtype, a device map or LoRA), after this call has verified them.
    """
    manifest = verify_checkpoint(path, fields)
    path = Path(path)
    if (path / LEGACY_STATE_FILE).is_file() and not (path / f"{STATE_STEM}.json").is_file():
        state = _load_legacy_state(path / LEGACY_STATE_FILE)
        where = str(path / LEGACY_STATE_FILE)
    else:
        try:
            state = load_plain_state(path, STATE_STEM)
        except PlainStateError as error:
            raise CheckpointError(str(error)) from None
        where = str(path / f"{STATE_STEM}.json")
    check_state(state, where, checkpoint_step(path, manifest, path / MARKER), fields)  # tensors where mappings were
    if restore_rng:
        try:
            restore_rng_state(state["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:  # the generators' states, altered
            raise CheckpointError(f"{where}: 'rng' holds no random generators' states ({error!r:.80})") from None
    return state


# what a legacy training_state.pt's pickle may name besides torch's own types: NumPy's RNG key array
LEGACY_NUMPY_GLOBALS = (np.ndarray, np.dtype, type(np.dtype(np.uint32)))


def _load_legacy_state(file: Path) -> dict[str, Any]:
    """A checkpoint written before the plain format: read by torch's weights-only unpickler, which
    calls nothing outside its allowlist (tensors, containers, and the NumPy names above); anything
    else in the pickle is refused. torch < 2.6's weights-only loader could be escaped
    (CVE-2025-32434), so there such a checkpoint is refused outright."""
    if tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
        raise CheckpointError(
            f"{file} was refused: an older posttrain's pickle, which torch {torch.__version__} cannot read safely. "
            "Resume with torch >= 2.6, or start from its weights without --resume (model.path=<that folder>)."
        )
    core = np.core if np.__version__.startswith("1.") else np._core
    try:
        with torch.serialization.safe_globals([core.multiarray._reconstruct, *LEGACY_NUMPY_GLOBALS]):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # UnpicklingError for a refused global; others for a damaged file
        named = re.search(r"GLOBAL (\S+)", str(error))
        why = f"its pickle names {named.group(1)}, which no checkpoint holds" if named else f"damaged ({error})"
        raise CheckpointError(f"{file} was refused: {why[:300]}. Reading it could run code; it was not read.") from None


def load_weights_into(model: Any, path: str | Path) -> None:
    """Copy a verified checkpoint's safetensors weights into ``model`` in place.

    Used on resume, where the optimizer already holds references to the model's parameters,
    so the module must be updated rather than rebuilt. Keys a save left out because they are
    tied to another parameter (e.g. lm_head ↔ embeddings) are accepted; any other missing or
    unexpected key is an error naming the checkpoint.
    """
    from safetensors.torch import load_file

    path = Path(path)
    verify_checkpoint(path)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != f"{STATE_STEM}.safetensors")
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    if is_peft_model(model):
        _load_adapters_into(model, state, path)
        return
    if is_sharded(model):  # FSDP2: each rank takes its shards of the whole weights
        untied = sorted({name for name, _ in model.named_parameters()} - set(state))
        unexpected = sorted(set(state) - set(model.state_dict()))
        if untied or unexpected:
            raise CheckpointError(f"{path} does not match the model: missing {untied[:5]}, unexpected {unexpected[:5]}")
        load_full_weights(model, state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded_storage = {p.data_ptr() for name, p in model.state_dict().items() if name in state}
    untied = [name for name in missing if model.state_dict()[name].data_ptr() not in loaded_storage]
    if untied or unexpected:
        raise CheckpointError(
            f"{path} does not match the model: missing {untied[:5]}, unexpected {list(unexpected)[:5]}"
        )


def _load_adapters_into(model: Any, state: dict[str, torch.Tensor], path: Path) -> None:
    """A LoRA (peft) checkpoint holds the adapters (and fully trained heads) only, under peft's
    saved names; the frozen base comes from ``model.path`` or the tiny model's seed, as at the
    start. Every trainable tensor must come from the checkpoint, and every saved one must land."""
    from peft import set_peft_model_state_dict

    if is_sharded(model):  # FSDP2: each rank takes its shards of the saved tensors, under the model's names
        saved = saved_adapter_names(model)
        untrained = sorted(name for key, name in saved.items() if key not in state)
        unexpected = sorted(set(state) - set(saved))
        if not untrained and not unexpected:
            _load_full(model, {saved[key]: tensor for key, tensor in state.items()}, path)
            return
    else:
        try:
            result = set_peft_model_state_dict(model, state)
        except (RuntimeError, KeyError, ValueError) as error:  # a shape mismatch: another rank or model
            raise CheckpointError(f"the adapters in {path} do not fit this LoRA model: {error}") from None
        missing = set(result.missing_keys)
        untrained = [name for name, p in model.named_parameters() if p.requires_grad and name in missing]
        unexpected = list(result.unexpected_keys)
    if untrained or unexpected:
        raise CheckpointError(
            f"the adapters in {path} do not match this LoRA model (model.lora / model.path changed?): "
            f"not in the checkpoint {untrained[:5]}, not in the model {unexpected[:5]}"
        )


def saved_adapter_names(model: Any) -> dict[str, str]:
    """``{name in a saved adapter file: parameter name}`` for every trainable tensor of a LoRA
    (peft) model: peft saves ``...lora_A.weight`` for the parameter ``...lora_A.default.weight``.
    Asked of peft itself (its save function over a dict that numbers the parameters), so the
    mapping is the one its own saving and loading use."""
    from peft import get_peft_model_state_dict

    names = [name for name, param in model.named_parameters() if param.requires_grad]
    numbered = {name: torch.tensor(i) for i, name in enumerate(names)}
    return {key: names[int(index)] for key, index in get_peft_model_state_dict(model, numbered).items()}


def _load_full(model: Any, state: dict[str, torch.Tensor], path: Path) -> None:
    try:
        load_full_weights(model, state)
    except (RuntimeError, KeyError, ValueError) as error:  # a shape mismatch: another model
        raise CheckpointError(f"the weights in {path} do not fit this model: {error}") from None


def weights_to_save(model: Any) -> dict[str, torch.Tensor] | None:
    """What :func:`save_checkpoint` writes of a model holding FSDP2 shards, gathered whole to rank 0
    (every rank calls this): a LoRA model's trainable tensors (its adapters and trained heads), any
    other model's every weight. None for a model that is not sharded (it saves its own)."""
    return world().full_weights(model, frozen=not is_peft_model(model))


def _write_manifest(folder: Path, step: int) -> None:
    files = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
        files[str(file.relative_to(folder))] = {"size": file.stat().st_size, "sha256": _sha256(file)}
    marker = folder / MARKER
    marker.write_text(json.dumps({"step": step, "files": files}, indent=1), encoding="utf-8")
    with marker.open("rb") as handle:
        os.fsync(handle.fileno())


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_final(
    model: Any, path: str | Path, tokenizer: Any = None, weights: dict[str, torch.Tensor] | None = None
) -> Path:
    """A run's ``final/`` folder: always a plain Hugging Face model folder (docs/design.md's run
    directory), so the next stage or any tool loads it by path. For a LoRA (peft) model that is
    the model with its adapters folded in, and the adapters alone go to ``final/adapter/``.
    ``weights``: the whole state dict of a model holding shards (FSDP2)."""
    path = Path(path)
    if is_peft_model(model):
        from posttrain.models.lora import save_merged
        from posttrain.rollout.weights import inference_weights, save_inference_folder, unmergeable_reason

        if unmergeable_reason(model) is None:
            # only the adapted projections get new tensors (W + scaling·B·A); merging a deep
            # copy held the whole model twice, the run's peak memory (SmolLM2-135M: +0.5 GB)
            save_inference_folder(model, tokenizer, path, inference_weights(model, weights))
        elif weights is None:  # DoRA and co: peft's own merge, on a copy
            save_merged(model, path, tokenizer=tokenizer)
        else:
            raise CheckpointError(f"{unmergeable_reason(model)} cannot be folded from FSDP2 shards: use strategy: ddp")
        model.save_pretrained(path / "adapter", state_dict=weights)
        return path
    model.save_pretrained(path, state_dict=weights)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
