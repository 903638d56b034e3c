"""A run's folder is where it was when the run started (hardening 3, item 14): an environment or tool
that calls ``os.chdir`` (user code runs in the trainer's process) moved the outputs written after it
— checkpoints, the final model, the report — into another folder."""

from __future__ import annotations

import os

from posttrain.cli import main
from tests.sources.data_side_envs import FlatOrCoin
from tests.train.matrix_features import write_rows


class Wanders(FlatOrCoin):
    """FlatOrCoin, changing the working directory at every step."""

    def __init__(self, to: str) -> None:
        self.to = to

    def step(self, completion):
        os.chdir(self.to)
        return super().step(completion)


def test_an_environment_that_changes_directory_does_not_move_the_run(tmp_path, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    data = write_rows(home / "rows.jsonl")
    monkeypatch.chdir(home)
    args = ["rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", f"data.path={data}",
            "env.name=tests.run.test_run_paths:Wanders", f"env.options.to={elsewhere}", "env.max_turns=3",
            "rewards=[]", "steps=2", "save_every=1", "prompts_per_step=2", "samples_per_prompt=2",
            "max_new_tokens=4", "eval_size=0", "report_to=[]", "reward_workers=0", "output_dir=run"]  # fmt: skip
    assert main(args) == 0
    assert (home / "run" / "final" / "model.safetensors").is_file()
    assert (home / "run" / "checkpoints" / "step-2" / "COMPLETE").is_file()
    assert (home / "run" / "report.html").is_file()
    assert not (elsewhere / "run").exists()
