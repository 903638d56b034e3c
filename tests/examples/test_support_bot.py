"""examples/support_bot.py, shortened: cold start on scripted episodes, then GRPO on support_bot
through `posttrain rl`; the summary's figures are what the runs logged."""

from __future__ import annotations

import json

import pytest

from posttrain.telemetry.metrics import read_jsonl
from tests.examples import load_example


@pytest.mark.slow
def test_the_support_bot_example_runs_both_stages_and_reports_what_it_measured(tmp_path):
    summary = load_example("support_bot").main(["--quick", "--output-dir", str(tmp_path)])
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    # the cold start stopped at its first validation check at or above the quick threshold
    assert summary["sft_validation_resolved"] >= 0.2 and summary["sft_steps"] < 200
    evals = [r for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl") if "eval/resolved" in r]
    assert summary["resolved"] == [evals[0]["eval/resolved"], evals[-1]["eval/resolved"]]
    steps = [r for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl") if "env/turns_mean" in r]
    assert len(steps) == 8 and all(r["env/errors"] == 0 for r in steps)
    conversation = read_jsonl(tmp_path / "grpo" / "samples.jsonl")[0]["completion"]
    assert conversation[0]["role"] == "assistant" and conversation[1]["role"] == "user"
