"""One run per folder: where a run starts, decided before any model loads.

- ``resume: none`` into a folder that already holds a run (metrics, checkpoints, a final model)
  is refused: appending would mix two runs in ``metrics.jsonl``, and retention would then delete
  the new run's checkpoints in favour of the old run's higher step numbers. ``overwrite: true``
  replaces the old run (its checkpoints, final model, logs and report are deleted first).
- ``resume: auto`` takes the newest checkpoint that verifies and says which newer ones it skipped
  and why; when checkpoints exist but none verifies it stops, naming each one, instead of
  silently starting over (and later deleting them by retention). With no checkpoint at all it
  starts from step 0 (a run killed before its first save).
- ``resume: PATH`` must be a checkpoint that verifies.
- In every resume, the config saved with the checkpoint is compared with the new one: a change
  of the model or the data (``model.*``, ``data.*``, ``seed``) is refused, naming the keys (it
  would fail later as a tensor-size dump, or train on other rows than the checkpoint's data
  position means); other changes (``steps``, ``save_every``, ...) are listed and accepted.

The run's ``config.yaml`` is written only after these checks pass, so a rejected config never
replaces the run's own.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.config import load_yaml
from posttrain.errors import PosttrainError
from posttrain.run.checkpoint import STEP_DIR, CheckpointError, checkpoint_root, verify_checkpoint
from posttrain.run.checkpoint_checks import NO_FIELDS, StateFields

RUN_FILES = (
    "metrics.jsonl", "samples.jsonl", "checkpoints", "final", "report.html", "tensorboard", "wandb", "wandb_id",
    "data_filter.json",
)  # fmt: skip
"""What a posttrain run writes into its folder (``overwrite`` deletes these, nothing else)."""

FIXED_ON_RESUME = ("model", "data", "seed")
"""Config keys (and sections) a resumed run must share with its checkpoint."""

IGNORED_ON_RESUME = ("resume", "overwrite", "output_dir")


class RunDirError(PosttrainError, ValueError):
    """The run folder and ``resume``/``overwrite`` do not fit together; the message says what to do."""


@dataclass
class StartPoint:
    """Where a run starts: ``checkpoint`` (None: step 0) and what the user should be told."""

    checkpoint: Path | None
    notes: list[str] = field(default_factory=list)


def existing_run(output_dir: str | Path) -> list[str]:
    """What in ``output_dir`` a new run would lose: checkpoints, a final model, metrics of
    finished steps. Empty for a new folder, and for the leftovers of an attempt that never
    finished a step (its logs hold at most the step-0 evaluation, which a new run redoes)."""
    out = Path(output_dir)
    found = []
    for name in ("checkpoints", "final"):
        if (out / name).is_dir() and any((out / name).iterdir()):
            found.append(name + "/")
    if _finished_steps(out / "metrics.jsonl"):
        found.append("metrics.jsonl")
    return found


def _finished_steps(metrics: Path) -> bool:
    if not metrics.is_file():
        return False
    with metrics.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                if int(json.loads(line).get("step", 0)) >= 1:
                    return True
            except (ValueError, TypeError, AttributeError):
                return True  # unreadable: treat as a run's, never silently replace it
    return False


def start_point(
    output_dir: str | Path,
    resume: str,
    overwrite: bool,
    config_yaml: str | None,
    steps: int | None = None,
    fields: StateFields = NO_FIELDS,
) -> StartPoint:
    """Decide where the run in ``output_dir`` starts; raise :class:`RunDirError` when it cannot, or
    when the checkpoint is already past ``steps`` (nothing would run). A checkpoint is usable when it
    verifies, its state holding the loop's ``fields``. Reads only: nothing is deleted or written
    here (see :func:`prepare_run_dir`)."""
    start = _start_point(Path(output_dir), resume, overwrite, config_yaml, fields)
    if steps is None or start.checkpoint is None:
        return start
    named = STEP_DIR.match(start.checkpoint.name)  # a path given to --resume may be named otherwise
    at = int(named.group(1)) if named else None
    if at is not None and at > steps:
        raise RunDirError(
            f"resume={resume}: {start.checkpoint} is at step {at}, past steps={steps}, so nothing would run. "
            f"Raise steps above {at} to train on, or resume from an earlier checkpoint"
        )
    if at == steps:
        start.notes.append(f"{start.checkpoint.name} is at steps={steps} already: no step left to run")
    return start


def _start_point(out: Path, resume: str, overwrite: bool, config_yaml: str | None, fields: StateFields) -> StartPoint:
    _check_writable(out)
    if resume == "none":
        found = existing_run(out)
        if found and not overwrite:
            raise RunDirError(
                f"output_dir {out} already holds a run ({', '.join(found)}). Continue it with --resume auto "
                "(resume=auto), choose another output_dir, or pass overwrite=true to delete it and start over"
            )
        return StartPoint(None)
    if overwrite:
        raise RunDirError(f"overwrite=true deletes the run in {out}, resume={resume} continues it: choose one")
    if resume == "auto":
        return _newest_usable(out, config_yaml, fields)
    path = Path(resume)
    try:
        verify_checkpoint(path, fields)
    except CheckpointError as error:
        raise RunDirError(f"resume={resume}: {error}") from None
    return StartPoint(path, _compare_configs(path, config_yaml))


def _check_writable(out: Path) -> None:
    """``output_dir`` must be a folder this process can create or write in."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out else f"is inside {existing}, which is a file"
        raise RunDirError(f"output_dir {out} {where}: choose a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"output_dir {out}: {existing} is not writable by this user; choose another folder")


def prepare_run_dir(
    output_dir: str | Path,
    resume: str,
    overwrite: bool,
    config_yaml: str | None,
    echo: Callable[[str], None] = print,
    fields: StateFields = NO_FIELDS,
) -> Path | None:
    """:func:`start_point`, then make the folder ready: an overwritten run's files are deleted,
    the notes are said and ``config.yaml`` written. Returns the checkpoint to resume from."""
    out = Path(output_dir)
    start = start_point(out, resume, overwrite, config_yaml, fields=fields)
    if resume == "none":  # a new run: the earlier one (asked to overwrite) or an aborted attempt's logs go
        replaced = existing_run(out)
        for name in RUN_FILES:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        if replaced:
            echo(f"[run] overwrite=true: deleted the earlier run in {out} ({', '.join(replaced)})")
    for note in start.notes:
        echo(f"[resume] {note}")
    out.mkdir(parents=True, exist_ok=True)
    if config_yaml is not None:
        (out / "config.yaml").write_text(config_yaml, encoding="utf-8")
    return start.checkpoint


def _newest_usable(out: Path, config_yaml: str | None, fields: StateFields) -> StartPoint:
    root = checkpoint_root(out)
    steps = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and child.is_dir():
                steps.append((int(match.group(1)), child))
    skipped: list[str] = []
    for _, path in sorted(steps, reverse=True):
        try:
            verify_checkpoint(path, fields)
        except CheckpointError as error:
            skipped.append(f"skipped {path.name}: {error}")
            continue
        notes = [*skipped, f"continuing from {path}", *_compare_configs(path, config_yaml)]
        return StartPoint(path, notes)
    if skipped:
        raise RunDirError(
            f"--resume auto: none of the {len(skipped)} checkpoints in {root} can be used:\n  - "
            + "\n  - ".join(s.removeprefix("skipped ") for s in skipped)
            + "\nNothing was changed. Resume from a good copy with resume=PATH, or start a new run in another "
            "output_dir (or overwrite=true with resume=none to replace this one)"
        )
    return StartPoint(None, [f"no checkpoint in {out} yet: starting from step 0"] if existing_run(out) else [])


def _compare_configs(checkpoint: Path, config_yaml: str | None) -> list[str]:
    """Refuse a change of model, data or seed since ``checkpoint``; list the other changes."""
    saved_file = checkpoint / "config.yaml"
    if config_yaml is None or not saved_file.is_file():
        return []
    try:  # the checkpoint's file may come from anyone: read as configs are (an alias bomb is refused)
        saved = load_yaml(saved_file.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{saved_file} cannot be read: {error}") from None
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{saved_file} holds a {type(saved).__name__}, not a config's mapping of keys")
    saved = _flatten(saved)
    new = _flatten(load_yaml(config_yaml) or {})
    # keys in one config only are options a newer or older posttrain added: not a change the user made
    changed = sorted(
        key
        for key in saved.keys() & new.keys()
        if saved[key] != new[key] and key.split(".")[0] not in IGNORED_ON_RESUME
    )
    fixed = [key for key in changed if key.split(".")[0] in FIXED_ON_RESUME]
    if fixed:
        listed = "; ".join(f"{key}: {saved.get(key)!r} then, {new.get(key)!r} now" for key in fixed[:8])
        raise RunDirError(
            f"cannot resume from {checkpoint}: the model or data changed since it was saved ({listed}). "
            "Use the checkpoint's own values (its config.yaml), or start a new run in another output_dir"
        )
    return [f"changed since {checkpoint.name}: {key} {saved.get(key)!r} → {new.get(key)!r}" for key in changed]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
