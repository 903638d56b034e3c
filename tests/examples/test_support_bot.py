"""examples/support_bot.py, shortened: cold start on scripted episodes, then GRPO on support_bot
through `posttrain rl`; the summary's figures are what the runs logged."""

from __future__ import annotations

import json

import pytest

from posttrain.telemetry.metrics import read_jsonl
from tests.examples import load_example


@pytest.mark.slow
def test_the_support_bot_example_runs_both_stages_and_rl_resolves_more_in_fewer_turns(tmp_path):
    summary = load_example("support_bot").main(["--quick", "--output-dir", str(tmp_path)])
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["sft_steps"] == 300
    records = read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
    evals = [r for r in records if "eval/resolved" in r]
    assert [r["step"] for r in evals] == [0, 100]  # before and after RL
    for name, key in (("resolved", "resolved"), ("turns_per_resolution", "turns_per_resolution"), ("return", "reward")):
        assert summary[f"greedy_{name}"] == [evals[0][f"eval/{key}"], evals[-1][f"eval/{key}"]]
        assert summary[f"sampled_{name}"] == [evals[0][f"eval/sampled_{key}"], evals[-1][f"eval/sampled_{key}"]]
    # the direction of the table in docs/examples.md, over 48 held-out rows x 4 sampled episodes
    before, after = zip(summary["sampled_resolved"], summary["sampled_turns_per_resolution"], strict=True)
    assert after[0] > before[0] and after[1] < before[1], summary
    assert summary["sampled_return"][1] > summary["sampled_return"][0]
    steps = [r for r in records if "env/turns_mean" in r]
    assert len(steps) == 100 and all(r["env/errors"] == 0 for r in steps)
    conversation = read_jsonl(tmp_path / "grpo" / "samples.jsonl")[0]["completion"]
    assert conversation[0]["role"] == "assistant" and conversation[0]["content"].startswith(("ask: ", "fix: "))
