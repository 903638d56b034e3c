"""A checkpoint never runs code (issue 45, item 1). Checkpoints travel between people and
machines, and the manifest's checksums are written by whoever wrote the checkpoint, so they prove
integrity, not origin: a crafted training state with its checksums recomputed must be refused by
``--resume`` (exit 2, one message) without running anything, for every training command.

The crafted states are the pickles an attacker would write: ``os.system``, ``subprocess.Popen``,
``builtins.exec`` / ``eval``, and the same call hidden inside a NumPy object array (reached through
the NumPy names a legacy checkpoint's RNG state needs). Each would create a marker file.
"""

from __future__ import annotations

import builtins
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.cli import main
from posttrain.run.checkpoint import LEGACY_STATE_FILE, STATE_STEM, _write_manifest, load_training_state
from tests.cli.bad_inputs import BASE

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_b5492cf"


class _System:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Popen(_System):
    def __reduce__(self):
        return (subprocess.Popen, (["touch", str(self.marker)],))


class _Exec(_System):
    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


class _Eval(_System):
    def __reduce__(self):
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


def _through_numpy(marker: Path) -> np.ndarray:
    return np.array([_System(marker)], dtype=object)


ATTACKS = {
    "os.system": _System,
    "subprocess.Popen": _Popen,
    "builtins.exec": _Exec,
    "builtins.eval": _Eval,
    "numpy object array": _through_numpy,
}


def craft(checkpoint: Path, payload: object, *, zip_format: bool) -> None:
    """Replace the checkpoint's training state by a pickle holding ``payload`` beside a plausible
    state, and recompute the manifest as an attacker would."""
    for name in (f"{STATE_STEM}.json", f"{STATE_STEM}.safetensors"):
        (checkpoint / name).unlink(missing_ok=True)
    state = {"step": 1, "rng": {"torch": torch.get_rng_state()}, "payload": payload}
    if zip_format:
        torch.save(state, checkpoint / LEGACY_STATE_FILE)
    else:
        (checkpoint / LEGACY_STATE_FILE).write_bytes(pickle.dumps(state))
    (checkpoint / "COMPLETE").unlink()
    _write_manifest(checkpoint, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One real step-1 checkpoint per training command."""
    made = {}
    for command in ("sft", "rm", "dpo", "rl"):
        out = tmp_path_factory.mktemp(command)
        assert main([*BASE[command], "steps=1", "save_every=1", f"output_dir={out}/run"]) == 0
        made[command] = out / "run" / "checkpoints" / "step-1"
    return made


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "rl"])
def test_a_resumed_checkpoint_is_read_without_pickle(checkpoints, command):
    checkpoint = checkpoints[command]
    names = {p.name for p in checkpoint.iterdir()}
    assert {f"{STATE_STEM}.json", f"{STATE_STEM}.safetensors"} <= names and LEGACY_STATE_FILE not in names
    state = load_training_state(checkpoint, restore_rng=False)
    assert state["step"] == 1 and isinstance(state["rng"]["python"], tuple)


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch.save", "raw pickle"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "rl"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(checkpoints, tmp_path, capsys, command, attack, zip_format):
    checkpoint = tmp_path / "step-1"
    shutil.copytree(checkpoints[command], checkpoint)
    marker = tmp_path / "marker"
    craft(checkpoint, ATTACKS[attack](marker), zip_format=zip_format)
    status = main([*BASE[command], "steps=2", f"output_dir={tmp_path}/resumed", "--resume", str(checkpoint)])
    err = capsys.readouterr().err
    assert not marker.exists(), f"the crafted checkpoint ran code ({attack})"
    assert status == 2
    assert "Traceback" not in err and LEGACY_STATE_FILE in err and "refused" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_a_checkpoint_of_b5492cf_still_resumes(tmp_path, capsys):
    """The fixture is an RL checkpoint written by b5492cf (pickled training state, NumPy RNG key
    array included): it loads through the weights-only reader and the run resumes from it."""
    if tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
        pytest.skip("torch < 2.6 refuses legacy checkpoints (tested by the refusal below)")
    checkpoint = tmp_path / "step-2"
    shutil.copytree(FIXTURE, checkpoint)
    state = load_training_state(checkpoint)
    assert state["step"] == 2 and np.random.get_state()[1].dtype == np.uint32
    assert sorted(state["optimizer"]["state"]) == list(range(12))
    overrides = (checkpoint / "config.yaml").read_text()
    assert "reverse" in overrides
    status = main([
        "rl", "--config", str(checkpoint / "config.yaml"), "steps=3", f"output_dir={tmp_path}/run",
        "save_every=0", "--resume", str(checkpoint),
    ])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_no_checkpoint_or_recording_reader_unpickles():
    """Statically: the package never calls ``torch.load`` without ``weights_only=True``, never
    ``numpy.load`` with pickles allowed, and ``pickle.load(s)`` only where the reward pool reads
    its own worker processes' replies (never a file)."""
    ipc_only = {"posttrain/rewards/pool.py", "posttrain/rewards/ray_pool.py"}
    for file in sorted((REPO / "posttrain").rglob("*.py")):
        text = file.read_text(encoding="utf-8")
        name = str(file.relative_to(REPO))
        for call in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", text):
            assert "weights_only=True" in call.group(0), f"{name}: {call.group(0)}"
        assert "weights_only=False" not in text and "allow_pickle=True" not in text, name
        if name not in ipc_only:
            assert not re.search(r"pickle\.loads?\(|\bUnpickler\b", text), name
