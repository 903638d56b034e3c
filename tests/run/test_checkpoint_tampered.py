"""A checkpoint is anyone's folder (hardening 3, items 1, 3 and 10): its manifest's checksums are
written by whoever wrote it, so a tampered state with its checksums recomputed must be refused by
name, before anything of the run is touched — never read as a step it is not (a state saying
``step: -1`` truncated ``metrics.jsonl`` and retrained from step 0 over the run's checkpoints),
never a traceback, and a manifest never makes a resume read a file outside the checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.run.checkpoint import MARKER, STATE_STEM, CheckpointError, _write_manifest, verify_checkpoint
from tests.run.test_run_dir import RL, SFT, snapshot


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A finished two-step run per loop, a checkpoint after each step."""
    made = {}
    for name, command in (("sft", SFT), ("rl", RL)):
        run = tmp_path_factory.mktemp(name) / "run"
        assert main([*command, "steps=2", "save_every=1", "keep_last=5", f"output_dir={run}"]) == 0
        made[name] = run
    return made


@pytest.fixture(params=["sft", "rl"])
def run(request, runs, tmp_path) -> tuple[list[str], Path]:
    copy = tmp_path / "run"
    shutil.copytree(runs[request.param], copy)
    return (SFT if request.param == "sft" else RL), copy


def tamper_state(checkpoint: Path, change) -> None:
    """Edit the state's JSON and recompute the manifest, as whoever hands the checkpoint on could."""
    path = checkpoint / f"{STATE_STEM}.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))
    resign(checkpoint)


def resign(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MARKER).read_text())
    (checkpoint / MARKER).unlink()
    _write_manifest(checkpoint, manifest["step"])


def refused(command: list[str], run: Path, resume: str, capsys) -> str:
    """Resume ``run`` from ``resume``: exit 2, one message (a YAML error quotes its line below it),
    no traceback, the run folder unchanged."""
    before = snapshot(run)
    capsys.readouterr()
    status = main([*command, "steps=4", f"output_dir={run}", "--resume", resume])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.startswith("posttrain ")]) == 1
    assert snapshot(run) == before
    return err


@pytest.mark.parametrize("step", [-1, 10**12, 0, "2", True, 2.5, None], ids=repr)
def test_a_state_whose_step_is_not_its_folders_is_refused_and_nothing_is_lost(run, capsys, step):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    tamper_state(checkpoint, lambda state: state.update(step=step))
    err = refused(command, folder, str(checkpoint), capsys)
    assert f"{STATE_STEM}.json" in err and "step" in err and "step-2" in err


def test_resume_auto_skips_the_tampered_checkpoint_naming_the_field(run, capsys):
    command, folder = run
    tamper_state(folder / "checkpoints" / "step-2", lambda state: state.update(step=-1))
    metrics = (folder / "metrics.jsonl").read_text().splitlines()
    capsys.readouterr()
    assert main([*command, "steps=3", f"output_dir={folder}", "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert "[resume] skipped step-2:" in out and "step" in out
    assert f"continuing from {folder / 'checkpoints' / 'step-1'}" in out
    # the step-1 rows are the run's own, kept; nothing was retrained from step 0
    rows = (folder / "metrics.jsonl").read_text().splitlines()
    assert rows[0] == metrics[0] and [json.loads(row)["step"] for row in rows] == [1, 2, 3]


@pytest.mark.parametrize("field", ["optimizer", "scheduler", "rng"])
def test_a_state_missing_a_field_is_refused_naming_it(run, capsys, field):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    tamper_state(checkpoint, lambda state: state.pop(field))
    err = refused(command, folder, str(checkpoint), capsys)
    assert repr(field) in err and f"{STATE_STEM}.json" in err


def test_a_state_field_of_the_wrong_type_is_refused_naming_it(run, capsys):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    tamper_state(checkpoint, lambda state: state.update(optimizer=[1, 2], scheduler="fast"))
    err = refused(command, folder, str(checkpoint), capsys)
    assert "'optimizer'" in err and "list" in err


@pytest.mark.parametrize("name", ["../../outside", "ABSOLUTE", "./../step-1/config.yaml", "../step-2/../../outside"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused_before_it_is_read(run, capsys, name):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    outside = folder / "outside"
    outside.write_text("a file of someone else's")
    name = str(outside) if name == "ABSOLUTE" else name
    manifest = json.loads((checkpoint / MARKER).read_text())
    # a correct size and checksum: only where the file lies gives it away
    reference = (checkpoint / name) if not Path(name).is_absolute() else Path(name)
    digest = hashlib.sha256(reference.read_bytes()).hexdigest()
    manifest["files"][name] = {"size": reference.stat().st_size, "sha256": digest}
    (checkpoint / MARKER).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside"):
        verify_checkpoint(checkpoint)
    err = refused(command, folder, str(checkpoint), capsys)
    assert name in err


BAD_MANIFESTS = [[], {"files": []}, {"files": {"config.yaml": 5}}, {"files": {"config.yaml": {"size": "1"}}}]


@pytest.mark.parametrize("manifest", BAD_MANIFESTS, ids=["list", "files list", "entry number", "size text"])
def test_a_manifest_of_the_wrong_shape_is_refused(run, capsys, manifest):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    (checkpoint / MARKER).write_text(json.dumps(manifest))
    err = refused(command, folder, str(checkpoint), capsys)
    assert MARKER in err


def test_a_manifest_whose_step_is_not_its_folders_is_refused(run, capsys):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    (checkpoint / MARKER).unlink()
    _write_manifest(checkpoint, 7)
    err = refused(command, folder, str(checkpoint), capsys)
    assert MARKER in err and "step 7" in err


def test_weights_whose_header_lies_are_refused_naming_the_file(run, capsys):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    weights = next(p for p in checkpoint.glob("*.safetensors") if p.name != f"{STATE_STEM}.safetensors")
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    tensor = next(key for key in header if key != "__metadata__")
    header[tensor]["data_offsets"][1] += 10**9  # a tensor that reaches far past the file's end
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    resign(checkpoint)
    err = refused(command, folder, str(checkpoint), capsys)
    assert weights.name in err


@pytest.mark.parametrize("text", ["- a\n- b\n", "5\n", "model: [1\n"], ids=["list", "number", "broken"])
def test_a_checkpoint_config_that_is_no_mapping_is_refused_naming_it(run, capsys, text):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    (checkpoint / "config.yaml").write_text(text)
    resign(checkpoint)
    err = refused(command, folder, str(checkpoint), capsys)
    assert "config.yaml" in err


@pytest.mark.parametrize("rng", [{}, {"python": [1, 2]}], ids=repr)
def test_random_states_lacking_a_generator_are_refused_naming_them(run, capsys, rng):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    tamper_state(checkpoint, lambda state: state.update(rng=rng))
    err = refused(command, folder, str(checkpoint), capsys)
    assert "'rng' lacks the" in err and f"{STATE_STEM}.json" in err


def test_random_states_of_the_wrong_kind_are_one_message(run, capsys):
    command, folder = run
    checkpoint = folder / "checkpoints" / "step-2"
    tamper_state(checkpoint, lambda state: state.update(rng={"python": 5, "numpy": 5, "torch": 5}))
    capsys.readouterr()
    assert main([*command, "steps=4", f"output_dir={folder}", "--resume", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "'rng' holds no random generators' states" in err and "Traceback" not in err
