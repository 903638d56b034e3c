"""``posttrain view`` over a run folder from someone else (hardening 3, items 2 and 8): whatever the
folder holds is text on the page — a reward name written as markup is not parsed as markup, recorded
text holding ``<!--<script>`` does not empty the page — a malformed ``alarm.json``, a prepared file
lacking a field or ``rewards: 5`` in the run's config leave the page drawing what it can, and a bad
``--output`` is one message. The page's script is checked in a real browser where Chromium is
installed (``.ci/run`` installs it)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from posttrain.cli import main
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.batch import RolloutBatch
from posttrain.sources.recorded import write_batch
from posttrain.view.rollout_page import render_page
from posttrain.view.rollout_view import view_data
from tests.telemetry.test_report_browser import CHROMIUM, Opened, browser  # noqa: F401 (a fixture)

MARKUP = "<b id=injected>bold</b><img src=x onerror=injected()>"
HIDDEN = "before <!--<script> after </script><script>injected()</script>"
ALARMS = [
    {"step": 3},
    {"step": "x", "monitor": {"name": MARKUP, "before": "high", "after": None}},
    {"step": 3, "monitor": {"name": "m", "before": 1.0, "after": 0.0}, "steps": {"after": "all"}, "optimised": []},
    {"step": 3, "monitor": {"name": "m", "before": 1, "after": 0}, "optimised": {"before": 0, "after": 1},
     "steps": {"before": [1, 2], "after": [3, 4]}, "samples": [5, "x"]},
    [1, 2, 3],
]  # fmt: skip


def recorded_run(run_dir: Path, config: str, prompt: str = "add 2 and 3") -> Path:
    """A run folder holding one recorded step of one sample, its tokenizer and ``config`` as its config.yaml."""
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(run_dir / "final")
    (run_dir / "config.yaml").write_text(config)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 1.0}\n')
    prompt_ids = tokenizer("add", add_special_tokens=False)["input_ids"]
    response = tokenizer("five", add_special_tokens=False)["input_ids"]
    batch = RolloutBatch(
        prompt_ids=torch.tensor([prompt_ids]),
        prompt_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        response_ids=torch.tensor([response]),
        response_mask=torch.ones(1, len(response)),
        engine_logprobs=torch.full((1, len(response)), -0.5),
        group_ids=torch.tensor([0]),
        truncated=torch.tensor([False]),
        policy_version=torch.tensor([0]),
        prompts=[prompt],
        completions=["five"],
        columns={},
        scores=torch.tensor([1.0]),
        reward_components=torch.tensor([[1.0]]),
        response_attention=torch.ones(1, len(response), dtype=torch.long),
    )
    write_batch(run_dir / "rollouts", 1, batch, {})
    return run_dir


def embedded(page: str) -> str:
    return re.search(r"<script type='application/json' id='data'>(.*?)</script>", page, re.S).group(1)


def test_the_embedded_data_holds_no_markup_and_reads_back_whole():
    data = {"run": "r", "components": [MARKUP], "samples": [{"prompt": HIDDEN, "text": "a & b > c"}], "steps": [1]}
    text = embedded(render_page(data))
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == data


@pytest.mark.parametrize("rewards", ["5", "{a: 1}", "[[1, 2], {name: 3}]", "'just a string'"])
def test_rewards_of_any_shape_in_the_runs_config_still_draw_the_page(tmp_path, capsys, rewards):
    run_dir = recorded_run(tmp_path / "run", f"rewards: {rewards}\n")
    assert main(["view", str(run_dir)]) == 0, capsys.readouterr().err
    assert len(view_data(run_dir)["samples"]) == 1


@pytest.mark.parametrize("config", ["[1, 2]", "model: [1\n", "env: 5\nmodel: 7\n", "env: {options: [1]}\n"])
def test_a_config_of_any_shape_still_draws_the_page(tmp_path, capsys, config):
    run_dir = recorded_run(tmp_path / "run", config)
    assert main(["view", str(run_dir)]) == 0, capsys.readouterr().err


def test_an_alias_bomb_in_the_runs_config_is_not_expanded(tmp_path, capsys):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    run_dir = recorded_run(tmp_path / "run", bomb + "rewards: [r]\n")
    started = time.monotonic()
    assert main(["view", str(run_dir)]) == 0, capsys.readouterr().err
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("alarm", ALARMS, ids=range(len(ALARMS)))
def test_a_malformed_alarm_is_left_out_of_the_view_and_the_report(tmp_path, capsys, alarm):
    run_dir = recorded_run(tmp_path / "run", "rewards: [r]\n")
    (run_dir / "alarm.json").write_text(json.dumps(alarm))
    assert main(["view", str(run_dir)]) == 0, capsys.readouterr().err
    assert view_data(run_dir)["alarm"] is None
    assert main(["report", str(run_dir)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("dropped", ["response_mask", "group_ids", "response_ids", "advantages"])
def test_a_prepared_file_lacking_a_field_costs_only_the_advantages(tmp_path, capsys, dropped):
    run_dir = recorded_run(tmp_path / "run", "rewards: [r]\n")
    prepared = {
        "response_mask": torch.ones(1, 4),
        "group_ids": torch.tensor([0]),
        "response_ids": torch.tensor([[5, 6, 7, 8]]),
        "advantages": torch.ones(1, 4),
    }
    prepared.pop(dropped)
    save_file(prepared, str(next((run_dir / "rollouts").glob("*.safetensors")).with_suffix(".prepared.safetensors")))
    assert main(["view", str(run_dir)]) == 0, capsys.readouterr().err


def test_output_into_a_folder_that_does_not_exist_is_one_message(tmp_path, capsys):
    run_dir = recorded_run(tmp_path / "run", "rewards: [r]\n")
    capsys.readouterr()
    assert main(["view", str(run_dir), "--output", str(tmp_path / "nowhere" / "page.html")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nowhere" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install chromium")
def test_nothing_from_the_run_folder_runs_or_parses_as_markup_in_a_browser(tmp_path, browser):  # noqa: F811
    run_dir = recorded_run(tmp_path / "run", f"rewards: ['{MARKUP}']\n", prompt=HIDDEN)
    (run_dir / "alarm.json").write_text(json.dumps(ALARMS[1]))
    assert main(["view", str(run_dir)]) == 0
    opened = Opened(browser, run_dir / "rollouts.html")
    assert opened.errors == []
    assert opened.page.locator(".card").count() == 1  # the page was not emptied
    assert opened.page.locator("#injected").count() == 0 and opened.page.locator(".card img").count() == 0
    assert MARKUP in opened.page.locator(".card .head").inner_text()
    assert opened.page.locator(".card .prompt").text_content() == HIDDEN
