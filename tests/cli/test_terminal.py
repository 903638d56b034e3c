"""What a person sees in the terminal: every training command opens with a header (what, on which
model, device and folder) and ends with its evaluation before → after; the live bar keeps the step
counter and the ETA in 80 columns; a short run prints no warning caused by posttrain's own code;
``posttrain eval`` prints a table and the failed examples and ``--output`` keeps its completions."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.telemetry.metrics import read_jsonl

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "report_to=[]"]
RL = [
    "rl", *TINY, "data.task=reverse", "data.n_train=64", "data.n_eval=10", "rewards=[reverse]",
    "allow_constant_reward=[reverse]", "steps=3", "prompts_per_step=4", "samples_per_prompt=2",
    "max_new_tokens=6", "reward_workers=0",
]  # fmt: skip
POSTTRAIN = [sys.executable, "-m", "posttrain"]


def test_rl_prints_a_header_and_its_held_out_evaluation_before_and_after(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*RL, f"output_dir={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("posttrain rl: algorithm (advantage grpo, loss ppo_clip")
    assert lines[1] == "  model   a tiny llama built here (1 layers × 32, char tokenizer)"
    assert "  step    4 prompts × 2 samples, up to 6 new tokens; 3 steps" in lines
    assert "  device  cpu, fp32, " in "\n".join(lines) and f"  output  {out}" in lines
    first, last = (r["eval/accuracy"] for r in read_jsonl(out / "metrics.jsonl") if "eval/accuracy" in r)
    assert f"[rl] held out, eval/accuracy: {first:.4g} → {last:.4g} (step 0 → 3)" in lines
    assert lines[-1] == f"[rl] done: model {out}/final, report {out}/report.html"
    answers = read_jsonl(out / "eval_samples.jsonl")  # every evaluation's answers, marked
    assert [a["step"] for a in answers] == [0] * 10 + [3] * 10
    assert {"prompt", "completion", "reward", "correct"} <= set(answers[0])


def test_sft_prints_its_header_and_its_held_out_loss_before_and_after(tmp_path, capsys):
    out = tmp_path / "sft"
    args = ["sft", *TINY, "data.task=reverse", "data.n_train=32", "data.n_eval=10", "steps=3", "batch_size=8"]
    assert main([*args, f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("posttrain sft\n  model   a tiny llama") and "  step    8 rows; 3 steps" in text
    assert re.search(r"\[sft\] held out, eval/\w+: \S+ → \S+ \(step 0 → 3\)", text), text
    # the held-out answers of the first and the last evaluation are kept, each marked
    answers = read_jsonl(out / "eval_samples.jsonl")
    assert [a["step"] for a in answers] == [0] * 10 + [3] * 10
    assert all(a["correct"] == (a["reward"] >= 1.0) for a in answers)


def in_a_terminal(command: list[str], cwd: Path, columns: int = 80) -> str:
    """``command``'s output as a pseudo-terminal of ``columns`` columns shows it, escapes removed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout is the terminal
        os.chdir(cwd)
        os.execvp(command[0], command)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    output = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, output.decode(errors="replace")[-2000:]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]", "", output.decode(errors="replace"))


def test_the_live_bar_keeps_the_step_counter_and_eta_in_80_columns(tmp_path):
    text = in_a_terminal([*POSTTRAIN, *RL, "steps=6", "eval_every=0", "output_dir=run"], tmp_path)
    frames = [line for line in re.split(r"[\r\n]", text) if line.startswith("rl ")]
    assert frames, text[-2000:]
    assert all(len(line) <= 80 for line in frames)
    assert re.search(r"\b6/6\b.*\beta\b", frames[-1]), frames[-1]
    # the metrics have a line of their own, cut at the edge rather than pushing the counter out
    assert any(line.startswith("reward/mean ") for line in re.split(r"[\r\n]", text))


@pytest.mark.parametrize("model", [["model.gradient_checkpointing=true"], ["model.lora.r=4"]], ids=["full", "lora"])
def test_a_short_run_prints_no_warning(tmp_path, model):
    """No Python warning (a FutureWarning of transformers' renamed property, a UserWarning) reaches
    the terminal of a plain run: each would be caused by posttrain's own calls."""
    # a reward the random model meets about half the time: the update then runs its forward passes
    (tmp_path / "vowel.py").write_text(
        "def has(prompts, completions, **kw):\n    return [float(any(c in 'aeiou' for c in x)) for x in completions]\n"
    )
    args = [*RL, "output_dir=run", "rewards=[vowel:has]", "allow_constant_reward=[]", *model]
    result = subprocess.run([*POSTTRAIN, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    warned = [line for line in (result.stdout + result.stderr).splitlines() if re.search(r"\w*Warning\b", line)]
    assert warned == []


def test_eval_prints_a_table_and_the_failed_examples_and_keeps_its_completions(tmp_path, capsys):
    assert main([*RL, f"output_dir={tmp_path / 'run'}"]) == 0
    capsys.readouterr()
    saved = tmp_path / "completions.jsonl"
    args = ["eval", "--model", str(tmp_path / "run" / "final"), "--n", "10", "--k", "2", "--max-new-tokens", "6"]
    assert main([*args, "--output", str(saved)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  greedy accuracy  \d\.\d{3} ± \d\.\d{3}$", text, re.M), text
    assert re.search(r"^  pass@2 +\d\.\d{3}$", text, re.M) and re.search(r"^  mean@2 +\d\.\d{3}", text, re.M)
    rows = read_jsonl(saved)
    failed = [row for row in rows if not row["correct"]]
    assert len(rows) == 10 and all({"prompt", "completion", "reward", "correct"} <= set(row) for row in rows)
    if failed:
        assert f"{len(failed)} of 10 rows without full marks" in text
        assert f"  prompt      {failed[0]['prompt']}" in text
    # a second run never writes over the first one's file; --json is the line a script reads
    before = saved.read_text()
    assert main([*args, "--output", str(saved)]) == 2
    assert "exists" in capsys.readouterr().err and saved.read_text() == before
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 10
