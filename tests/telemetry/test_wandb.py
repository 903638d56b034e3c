"""Weights & Biases from a config (issue 23, item 10): ``report_to: [wandb]`` logs every step's
metrics to a W&B run, and a resumed run continues the same W&B run. W&B runs offline here
(WANDB_MODE=offline): the real client writes its run file locally, which the test reads."""

from __future__ import annotations

import time

import pytest

from posttrain.cli import main

pytest.importorskip("wandb", reason="wandb is a dev dependency (pip install -e '.[dev]')")

SFT = ["sft", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse"]
SFT += ["data.n_train=32", "data.n_eval=9", "eval_size=0", "batch_size=4", "save_every=1", "report_to=[wandb]"]


def wandb_runs(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def written_record(path, needles, wait_s=60.0):
    """The run file once it holds every needle: W&B's service process writes it on its own
    after ``finish()`` returns (under load, the first read found only its header)."""
    deadline = time.monotonic() + wait_s
    while True:
        record = path.read_bytes()
        if all(needle in record for needle in needles) or time.monotonic() > deadline:
            return record
        time.sleep(0.2)


def test_report_to_wandb_logs_each_step_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert main([*SFT, "steps=2", f"output_dir={run}", "run_name=reversal-test"]) == 0
    run_id = (run / "wandb_id").read_text().strip()
    [first] = wandb_runs(run)
    assert first.name == f"run-{run_id}.wandb"
    # protobuf records: the metric names and the run name appear as strings
    record = written_record(first, [b"loss/sft", b"reversal-test", b"posttrain"])
    assert b"loss/sft" in record and b"reversal-test" in record and b"posttrain" in record

    assert main([*SFT, "steps=3", f"output_dir={run}", "run_name=reversal-test", "--resume", "auto"]) == 0
    assert [path.name for path in wandb_runs(run)] == [f"run-{run_id}.wandb"] * 2  # the same W&B run, resumed


def test_report_to_wandb_without_wandb_installed_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert main([*SFT, "steps=1", f"output_dir={tmp_path / 'run'}"]) == 2
    assert "pip install 'posttrain[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_held_out_answers_reach_wandb_as_a_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    evaluated = [arg for arg in SFT if arg != "eval_size=0"]  # the task's reward scores greedy answers
    assert main([*evaluated, "steps=1", f"output_dir={run}"]) == 0
    [record_file] = wandb_runs(run)
    record = written_record(record_file, [b"eval_samples", b"table-file"])
    assert b"eval_samples" in record and b"table-file" in record
    # the record points to the table; its rows (the held-out prompts and answers) are in W&B's table file
    tables = sorted(record_file.parent.glob("files/media/table/eval_samples_*.table.json"))
    assert tables and "Reverse the name" in tables[-1].read_text()
