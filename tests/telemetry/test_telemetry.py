"""Metrics sinks, resume truncation, progress lines and the HTML report."""

from __future__ import annotations

import json
import math
import re

import torch

from posttrain.telemetry import MetricsLogger, Progress, write_report
from posttrain.telemetry.metrics import read_jsonl
from posttrain.telemetry.svg_plots import line_svg


def test_jsonl_every_step_flushed_and_tensors_become_numbers(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss/policy": torch.tensor(0.5), "reward/mean": 0.25})
    # readable before close: a killed run keeps what it finished
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss/policy": 0.5, "reward/mean": 0.25}]
    logger.log(2, {"loss/policy": float("nan")})
    logger.log_samples(2, [{"prompt": "Reverse the name: sean. Answer:", "completion": " naes.", "reward": 1.0}])
    logger.close()
    assert str(read_jsonl(tmp_path / "metrics.jsonl")[1]["loss/policy"]) == "nan"
    assert read_jsonl(tmp_path / "samples.jsonl")[0]["completion"] == " naes."


def test_resume_drops_records_of_steps_to_be_redone(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": step})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "x"')  # torn line of a killed write
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
        logger.log(4, {"x": 40})
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_tensorboard_events_are_written(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"loss/sft": 1.0})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_plain_progress_lines_with_eta(capsys):
    progress = Progress(4, keys=["loss/sft"], every=2, label="sft", live=False)
    for step in range(1, 5):
        progress.update(step, {"loss/sft": 1.0 / step, "other": 3})
    progress.close()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[sft] step 2/4  loss/sft 0.5")
    assert "eta" in lines[1] and "other" not in lines[1]


def test_report_has_curves_values_and_escaped_samples(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 11):
            logger.log(step, {"loss/policy": 1 / step, "reward/mean": step / 10, "eval/accuracy": 0.5})
        logger.log_samples(10, [{"prompt": "<b>x</b>", "completion": " naes.", "reward": 1.0}])
    report = write_report(tmp_path, title="reverse")
    page = report.read_text()
    # the key curves in one figure; an inline plot of each changing metric, under its group's
    # heading (eval/accuracy is constant: no plot)
    assert {p.name for p in tmp_path.glob("report_*.png")} == {"report_key_curves.png"}
    assert "report_key_curves.png" in page and "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    plotted = re.findall(r"<h3>(\w+)</h3><div class='plots'><svg[^>]*><text[^>]*>(.*?)</text>", page)
    assert plotted == [("loss", "loss/policy"), ("reward", "reward/mean")]
    assert page.count("<svg") == 2 and page.count("<circle") == 20  # ten points each
    assert "<td>reward/mean</td><td>1</td>" in page
    assert "Constant throughout: eval/accuracy = 0.5." in page
    json.dumps(page)  # plain text, nothing binary


def test_held_out_answers_go_to_a_file_and_to_tensorboard_as_text(tmp_path):
    answers = [{"prompt": "Reverse the name: sean. Answer:", "completion": " naes.", "reward": 1.0, "correct": True}]
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log_eval_samples(3, answers)
    assert read_jsonl(tmp_path / "eval_samples.jsonl") == [{"step": 3, **answers[0]}]
    [events] = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    written = events.read_bytes()
    assert b"eval_samples" in written and b"| Reverse the name: sean. Answer: |  naes. | 1.0 | True |" in written


def test_a_metric_plot_breaks_its_line_at_a_missing_value():
    """NaN (a step that did not log the metric) splits the line; the range printed ignores it."""
    svg = line_svg("loss/value", [1, 2, 3, 4, 5], [0.5, 0.25, math.nan, 0.125, 1.0])
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 4
    assert ">1</text>" in svg and ">0.125</text>" in svg and "nan" not in svg
    assert ">step 1</text>" in svg and ">step 5</text>" in svg
