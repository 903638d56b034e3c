"""The README's "Your own task in ten lines" runs exactly as written: its shell block, read from
README.md, in an empty folder with the installed ``posttrain`` on the PATH.

The block takes its model from ``$MODEL`` (a real checkpoint by default, from the Hub); here
``MODEL`` names a stand-in built first: a tiny Llama given a few SFT steps on the four answers, so
that its samples are right sometimes — as a real model's are, and as the reward pre-flight check
needs — in seconds and offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from posttrain.cli import main
from posttrain.telemetry.metrics import read_jsonl

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "## Your own task in ten lines"


def recipe() -> str:
    """The one shell block under the README's heading, as written."""
    section = README.read_text(encoding="utf-8").split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the recipe is one ```bash block"
    return blocks[0]


def stand_in(folder: Path) -> Path:
    """A tiny Llama that has seen the recipe's four questions with their answers a few times."""
    rows = [("2 + 3", "5"), ("4 + 4", "8"), ("1 + 6", "7"), ("3 + 3", "6")]
    folder.mkdir(parents=True)
    data = folder / "answers.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {q}? Answer:", "completion": f" {a}"}) + "\n" for q, a in rows)
    )
    tiny = ["model.tiny.layers=1", "model.tiny.hidden=64", "report_to=[]", "learning_rate=3e-3", "batch_size=4"]
    assert main(["sft", *tiny, f"data.path={data}", "steps=30", f"output_dir={folder / 'sft'}"]) == 0
    return folder / "sft" / "final"


def test_the_readme_recipe_for_your_own_task_runs_as_written(tmp_path):
    model = stand_in(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "MODEL": str(model), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", recipe()], cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = work / "runs" / "my_task"
    rewards = [r["reward/mean"] for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert len(rewards) == 20 and max(rewards) > 0  # the answer column reached the reward, which scored
    assert (run / "final" / "config.json").is_file() and (run / "report.html").is_file()
    assert result.stdout.startswith("posttrain rl") and f"  model   {model}" in result.stdout
    assert "[rl] reward, batch mean: " in result.stdout
