"""Running out of memory ends a run in one message (exit 2, no traceback): the stage and step,
the peak seen, the keys that lower it, and where the run continues from — and it does continue."""

from __future__ import annotations

import re

import pytest
import torch

from posttrain.cli import main
from posttrain.rollout.engine import LocalEngine
from posttrain.train import offline
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_prepare import BatchPreparer

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "report_to=[]"]
RL = [
    "rl", *TINY, "data.task=reverse", "data.n_train=64", "data.n_eval=10", "rewards=[reverse]",
    "allow_constant_reward=[reverse]", "steps=3", "prompts_per_step=4", "samples_per_prompt=2",
    "max_new_tokens=6", "reward_workers=0", "save_every=1", "eval_size=0",
]  # fmt: skip


def message(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_an_update_that_runs_out_of_memory_names_the_stage_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    update = OnlineRL.update

    def update_that_runs_out(self, batch, step):
        if step == 2:  # a real allocation the CPU refuses, as a too-large micro-batch's would be
            torch.empty(1 << 50)
        return update(self, batch, step)

    monkeypatch.setattr(OnlineRL, "update", update_that_runs_out)
    assert main([*RL, f"output_dir={out}"]) == 2
    err = message(capsys)
    assert err.startswith("posttrain rl: ran out of memory in the update of step 2 (peak ")
    assert (
        re.search(
            r"It ran with micro_batch_tokens \d+, micro_batch_size unset, model.gradient_checkpointing false: "
            r"lower micro_batch_tokens",
            err,
        )
        and "model.gradient_checkpointing" in err
    )
    assert f"The last checkpoint, {out / 'checkpoints' / 'step-1'}, is intact: --resume auto" in err
    monkeypatch.setattr(OnlineRL, "update", update)
    assert main([*RL, f"output_dir={out}", "--resume", "auto"]) == 0
    assert (out / "checkpoints" / "step-3").is_dir()


@pytest.mark.parametrize(
    "patch,expected,remedy",
    [
        (
            "generate",
            "in the generation of step 1",
            "prompts_per_step 4, samples_per_prompt 2, max_new_tokens 6: lower prompts_per_step, samples_per_prompt",
        ),
        (
            "prepare",
            "in the log-probs of step 1",
            "micro_batch_size unset: lower micro_batch_tokens (tokens per forward pass) or micro_batch_size",
        ),
    ],
)
def test_each_stage_names_its_own_keys(tmp_path, capsys, monkeypatch, patch, expected, remedy):
    def runs_out(*args, **kwargs):  # as CUDA says it, on a machine without a GPU
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(LocalEngine if patch == "generate" else BatchPreparer, patch, runs_out)
    assert main([*RL, f"output_dir={tmp_path / 'run'}"]) == 2
    err = message(capsys)
    assert f"ran out of memory {expected} (peak " in err and remedy in err
    assert "No checkpoint was written yet" in err


def test_an_offline_step_that_runs_out_of_memory_says_what_to_lower(tmp_path, capsys, monkeypatch):
    def runs_out(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(offline, "_train_step", runs_out)
    args = ["sft", *TINY, "data.task=reverse", "data.n_train=32", "data.n_eval=10", "steps=2", "batch_size=8"]
    assert main([*args, f"output_dir={tmp_path / 'sft'}"]) == 2
    err = message(capsys)
    assert err.startswith("posttrain sft: ran out of memory in the training step of step 1")
    assert re.search(
        r"micro_batch_tokens \d+, batch_size 8, gradient_accumulation 1, model.gradient_checkpointing false: "
        r"lower micro_batch_tokens \(tokens per pass\) or batch_size",
        err,
    )


def test_other_errors_are_not_taken_for_out_of_memory(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(offline, "_train_step", fails)
    args = ["sft", *TINY, "data.task=reverse", "data.n_train=32", "data.n_eval=10", "steps=2", "batch_size=8"]
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main([*args, f"output_dir={tmp_path / 'sft'}"])
