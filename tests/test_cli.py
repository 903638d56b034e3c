import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.cli import build_parser
from posttrain.demo import DemoConfig


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, cwd=cwd, check=False
    )


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout
    demo_help = run_cli("demo", "--help")
    assert demo_help.returncode == 0
    for flag in ("--seed", "--output-dir", "--sft-steps", "--threads"):
        assert flag in demo_help.stdout


def test_no_command_prints_help_and_fails():
    result = run_cli()
    assert result.returncode == 2 and "commands" in result.stdout


def test_demo_flag_defaults_match_demo_config():
    args = build_parser().parse_args(["demo"])
    defaults = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    for name in ("seed", "output_dir", "sft_steps", "threads"):
        assert getattr(args, name) == defaults[name], name


@pytest.mark.slow
def test_demo_writes_a_loadable_run(tmp_path):
    result = run_cli("demo", "--sft-steps", "30", "--output-dir", "tmp", "--threads", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Test Set Exact Match Accuracy:" in result.stdout
    assert "Manual Examples Accuracy: " in result.stdout and "sean     → " in result.stdout
    run = tmp_path / "tmp"

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert {"loss/sft", "lr", "grad_norm"} <= set(metrics[0])
    assert metrics[-1]["loss/sft"] < metrics[0]["loss/sft"]

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 500 and samples[0]["name"] == "sean"
    assert {"prompt", "completion", "answer", "expected", "reward"} <= set(samples[0])

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    ids = tokenizer("Reverse the name: sean. Answer:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["sft_steps"] == 30 and 0.0 <= summary["accuracy_after"] <= 1.0
