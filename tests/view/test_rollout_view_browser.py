"""``posttrain view`` in a real headless browser (Chromium through Playwright): a recorded 3-step
run's page raises no script error and holds every recorded sample; filtering by reward hides the
others; a multi-turn run shows the environment's text between its turns, and its tool calls.

Needs Chromium and playwright, as tests/telemetry/test_report_browser.py (skipped without)."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.batch import RolloutBatch
from posttrain.sources.recorded import read_batch, recorded_steps, write_batch
from tests.telemetry.test_report_browser import CHROMIUM, TINY_RL, Opened, browser  # noqa: F401 (a fixture)
from tests.train.matrix_features import ENV, write_rows

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install chromium")
THREE_STEPS = [arg for arg in TINY_RL if not arg.startswith("steps=")] + ["steps=3"]


def opened_view(browser, run_dir) -> Opened:  # noqa: F811 (the fixture's name)
    assert main(["view", str(run_dir)]) == 0
    opened = Opened(browser, run_dir / "rollouts.html")
    opened.page.select_option("#size", "all")
    assert opened.errors == []
    return opened


def test_every_recorded_sample_is_on_the_page_and_reward_filters_them(tmp_path, browser):  # noqa: F811
    run_dir = tmp_path / "rl"
    assert main([*THREE_STEPS, f"output_dir={run_dir}"]) == 0  # records by default (record_rollouts: auto)
    steps = recorded_steps(run_dir / "rollouts")
    assert steps == [1, 2, 3]
    batches = [read_batch(run_dir / "rollouts", step)[0] for step in steps]
    opened = opened_view(browser, run_dir)
    cards = opened.page.locator(".card")
    assert cards.count() == sum(len(batch) for batch in batches) == 48
    for step, batch in zip(steps, batches, strict=True):  # each step's samples, in order, with their rewards
        shown = opened.page.locator(f".card[data-step='{step}'] .reward").all_inner_texts()
        assert [float(text) for text in shown] == pytest.approx(batch.scores.tolist())
    # per-token numbers are there: a hover title with the engine's log-prob and the advantage
    assert "logprob" in cards.first.locator(".tok").first.get_attribute("title")
    assert "advantage" in cards.first.locator(".tok").first.get_attribute("title")
    rewarded = sum(int((batch.scores >= 0.5).sum()) for batch in batches)
    assert 0 < rewarded < 48
    opened.page.fill("#rmin", "0.5")
    assert opened.page.locator(".card").count() == rewarded
    assert set(opened.page.locator(".card .reward").all_inner_texts()) == {"1"}
    opened.page.fill("#rmin", "")
    assert opened.page.locator(".card").count() == 48
    # the report links the page
    assert "rollouts.html" in (run_dir / "report.html").read_text(encoding="utf-8")
    assert opened.errors == []


def test_a_multi_turn_run_shows_its_turns(tmp_path, browser):  # noqa: F811
    run_dir = tmp_path / "env"
    data = write_rows(tmp_path / "rows.jsonl")
    args = ["rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", f"data.path={data}",
            f"env.name={ENV}", "env.max_turns=3", "rewards=[]", "steps=2", "prompts_per_step=4",
            "samples_per_prompt=2", "max_new_tokens=4", "eval_size=0", "report_to=[]", "reward_workers=0",
            f"output_dir={run_dir}"]  # fmt: skip
    assert main(args) == 0
    opened = opened_view(browser, run_dir)
    two_turns = opened.page.locator(".card:has(.env)")
    assert two_turns.count() > 0  # a coin row's episode: the policy, the environment's " again:", the policy
    assert "again:" in two_turns.first.locator(".env").first.inner_text()
    assert opened.errors == []


def test_tool_calls_are_listed_under_their_turn(tmp_path, browser):  # noqa: F811
    """A recorded episode whose first turn calls a tool (Hermes format) and whose second answers."""
    run_dir = tmp_path / "tools"
    tokenizer = build_char_tokenizer(charset='abcdefghijklmnopqrstuvwxyz0123456789 <>/{}":,[]_\n=+')
    tokenizer.save_pretrained(run_dir / "final")
    (run_dir / "config.yaml").write_text("env:\n  name: tools\n  options: {format: hermes}\nrewards: []\n")
    prompt = tokenizer("add 2 and 3", add_special_tokens=False)["input_ids"]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    pieces = [(call, 1), ("<tool_response>5</tool_response>\n", 0), ("the sum is 5", 1)]
    ids = [(i, sampled) for text, sampled in pieces for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    width = len(ids)
    batch = RolloutBatch(
        prompt_ids=torch.tensor([prompt]),
        prompt_mask=torch.ones(1, len(prompt), dtype=torch.long),
        response_ids=torch.tensor([[i for i, _ in ids]]),
        response_mask=torch.tensor([[float(s) for _, s in ids]]),
        engine_logprobs=torch.full((1, width), -0.5),
        group_ids=torch.tensor([0]),
        truncated=torch.tensor([False]),
        policy_version=torch.tensor([0]),
        prompts=["add 2 and 3"],
        completions=[json.dumps(pieces)],
        columns={},
        scores=torch.tensor([1.0]),
        response_attention=torch.ones(1, width, dtype=torch.long),
    )
    write_batch(run_dir / "rollouts", 1, batch, {})
    opened = opened_view(browser, run_dir)
    assert opened.page.locator(".card").count() == 1
    assert opened.page.locator(".calls li").all_inner_texts() == ['tool call add {"a":2,"b":3}']
    assert opened.page.locator(".env").inner_text().endswith("<tool_response>5</tool_response>\n")
    assert opened.errors == []
