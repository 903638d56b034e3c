"""One run per folder (issue 23, items 2 and 3), through the command line: a second run into a
folder that holds one is refused and changes nothing; ``overwrite=true`` replaces it;
``--resume auto`` says which checkpoint it skipped and why, stops when none can be used, and
refuses a changed model or dataset without touching the run's ``config.yaml``."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.run.checkpoint import list_checkpoints
from posttrain.telemetry.metrics import read_jsonl

SFT = ["sft", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse"]
SFT += ["data.n_train=32", "data.n_eval=9", "eval_size=0", "batch_size=4", "save_every=1", "keep_last=5"]
RL = ["rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse"]
RL += ["data.n_train=16", "data.n_eval=9", "eval_size=0", "prompts_per_step=2", "samples_per_prompt=2"]
RL += ["max_new_tokens=4", "reward_workers=0", "steps=1", "preflight=false"]


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_run(tmp_path) -> Path:
    run = tmp_path / "run"
    assert main([*SFT, "steps=3", f"output_dir={run}"]) == 0
    return run


@pytest.mark.parametrize("command", [SFT, RL], ids=["sft", "rl"])
def test_a_second_run_into_a_used_folder_is_refused_before_anything_loads(tmp_path, capsys, command):
    run = tmp_path / "run"
    assert main([*command, "steps=1", f"output_dir={run}"]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main([*command, "steps=2", "learning_rate=0.5", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert f"output_dir {run} already holds a run" in err and "--resume auto" in err and "overwrite=true" in err
    assert snapshot(run) == before  # nothing written, config.yaml included


def test_overwrite_replaces_the_earlier_run_whole(finished_run, capsys):
    assert main([*SFT, "steps=2", f"output_dir={finished_run}", "overwrite=true"]) == 0
    assert "deleted the earlier run" in capsys.readouterr().out
    assert [c.step for c in list_checkpoints(finished_run)] == [1, 2]  # not step-3 of the old run
    assert [r["step"] for r in read_jsonl(finished_run / "metrics.jsonl") if "lr" in r] == [1, 2]


def test_resume_auto_says_which_checkpoint_it_skipped_and_why(finished_run, capsys):
    weights = finished_run / "checkpoints" / "step-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after the save
    capsys.readouterr()
    assert main([*SFT, "steps=4", f"output_dir={finished_run}", "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert "[resume] skipped step-3: checkpoint file" in out and "truncated" in out
    assert f"continuing from {finished_run / 'checkpoints' / 'step-2'}" in out
    assert "changed since step-2: steps 3 → 4" in out


def test_resume_auto_with_no_usable_checkpoint_stops_and_deletes_nothing(finished_run, capsys):
    for checkpoint in list_checkpoints(finished_run):
        (checkpoint.path / "training_state.json").write_bytes(b"damaged")
    before = snapshot(finished_run)
    capsys.readouterr()
    assert main([*SFT, "steps=6", f"output_dir={finished_run}", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "none of the 3 checkpoints" in err and "Nothing was changed" in err
    assert all(f"step-{n}: checkpoint file" in err for n in (1, 2, 3))
    assert snapshot(finished_run) == before


def test_resume_with_a_changed_model_or_dataset_is_refused_naming_the_keys(finished_run, capsys):
    before = snapshot(finished_run)
    capsys.readouterr()
    assert main([*SFT, "steps=4", "model.tiny.hidden=64", f"output_dir={finished_run}", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "the model or data changed" in err and "model.tiny.hidden: 32 then, 64 now" in err
    assert main([*SFT, "steps=4", "data.n_train=48", f"output_dir={finished_run}", "--resume", "auto"]) == 2
    assert "data.n_train: 32 then, 48 now" in capsys.readouterr().err
    assert snapshot(finished_run) == before  # the rejected configs never replaced config.yaml


def test_resume_from_a_path_that_is_no_checkpoint_is_one_message(finished_run, capsys):
    missing = finished_run / "checkpoints" / "step-99"
    assert main([*SFT, "steps=4", f"output_dir={finished_run}", "--resume", str(missing)]) == 2
    assert f"resume={missing}: {missing} does not exist: a checkpoint is a folder" in capsys.readouterr().err
    missing.mkdir()
    assert main([*SFT, "steps=4", f"output_dir={finished_run}", "--resume", str(missing)]) == 2
    assert f"resume={missing}: {missing} is not a complete checkpoint" in capsys.readouterr().err
    assert main([*SFT, "steps=4", f"output_dir={finished_run}", "--resume", str(finished_run)]) == 2
    assert f"{finished_run} is a run folder, not a checkpoint" in capsys.readouterr().err


def test_overwrite_and_resume_together_are_refused(finished_run, capsys):
    assert main([*SFT, f"output_dir={finished_run}", "overwrite=true", "--resume", "auto"]) == 2
    assert "choose one" in capsys.readouterr().err


def test_resume_past_steps_is_refused_and_a_finished_run_says_so(finished_run, capsys):
    """Issue 45, item 4: --resume auto with steps below the checkpoint's step exited 0 without a word."""
    before = snapshot(finished_run)
    capsys.readouterr()
    assert main([*SFT, "steps=2", f"output_dir={finished_run}", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "step-3 is at step 3, past steps=2, so nothing would run" in err and "Raise steps above 3" in err
    assert snapshot(finished_run) == before
    assert main([*SFT, "steps=3", f"output_dir={finished_run}", "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert "[resume] step 3 restored" in out


@pytest.mark.parametrize("command", [SFT, RL], ids=["sft", "rl"])
def test_fsdp2_in_one_process_says_it_shards_nothing(tmp_path, capsys, command):
    """Issue 45, item 4: strategy=fsdp2 without torchrun ran as one process without a word."""
    assert main([*command, "steps=1", "strategy=fsdp2", f"output_dir={tmp_path / 'run'}"]) == 0
    assert "strategy = 'fsdp2' in a single process: there is nothing to shard" in capsys.readouterr().err
