"""What ``posttrain view`` reads and how much: a long run records one step in N (at most 200
steps; not replayable, and a replay says so), and the page over a very long recording stays
bounded. The page itself is opened in a browser by tests/view/test_rollout_view_browser.py."""

from __future__ import annotations

import os

import pytest

from posttrain.cli import main
from posttrain.sources.recorded import RecordingError, check_replay_folder, recorded_steps
from posttrain.train import rl_sources
from posttrain.view.rollout_view import MAX_STEPS, view_data, write_view
from tests.train.test_rl import SMALL, TINY

RUN = ["rl", *TINY, *SMALL, "rewards=[tests.train.test_rl:vowel_share]", "report_to=[]"]


def test_a_long_run_records_one_step_in_n_and_refuses_to_replay_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rl_sources, "RECORDED_STEPS_AUTO", 2)  # "long": more than 2 steps
    assert main([*RUN, "steps=5", f"output_dir={tmp_path / 'auto'}"]) == 0
    assert recorded_steps(tmp_path / "auto" / "rollouts") == [1, 4]  # every ⌈5 / 2⌉ = 3rd step
    with pytest.raises(RecordingError, match=r"holds one step in 3 only .* record with record_rollouts: true"):
        check_replay_folder(tmp_path / "auto" / "rollouts", steps=5)
    assert main([*RUN, "steps=3", "record_rollouts=true", f"output_dir={tmp_path / 'every'}"]) == 0
    assert recorded_steps(tmp_path / "every" / "rollouts") == [1, 2, 3]
    assert main([*RUN, "steps=2", "record_rollouts=false", f"output_dir={tmp_path / 'none'}"]) == 0
    assert not (tmp_path / "none" / "rollouts").exists() and not (tmp_path / "none" / "rollouts.html").exists()


def test_the_page_over_a_10000_step_recording_stays_bounded(tmp_path):
    run_dir = tmp_path / "run"
    assert main([*RUN, "steps=1", f"output_dir={run_dir}"]) == 0
    folder = run_dir / "rollouts"
    one_step = os.path.getsize(write_view(run_dir))
    for step in range(2, 10_001):  # the same batch as 10,000 steps (links: no copies)
        for suffix in (".json", ".safetensors"):
            os.link(folder / f"step-000001{suffix}", folder / f"step-{step:06d}{suffix}")
    data = view_data(run_dir)
    assert data["recorded_steps"] == 10_000
    assert len(data["steps"]) == MAX_STEPS and data["steps"][0] == 1 and data["steps"][-1] == 10_000
    assert len(data["samples"]) == MAX_STEPS * 16
    assert os.path.getsize(write_view(run_dir)) < 1.1 * MAX_STEPS * one_step
