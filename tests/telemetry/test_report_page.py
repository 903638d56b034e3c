"""The report reads headline first: warnings, a summary (held-out first → last, reward, KL, time),
the key curves, the last step's best, median and worst completions, the held-out answers marked,
then every metric folded away; a section with nothing in it is left out, and ``posttrain report``
draws the same page again from the run's files."""

from __future__ import annotations

import re

from posttrain.cli import main
from posttrain.telemetry import MetricsLogger, write_report
from posttrain.telemetry.report import rebuild_report


def headings(page: str) -> list[str]:
    return re.findall(r"<h2>([^<]*)</h2>", page)


def logged_run(folder, *, with_samples: bool = True) -> None:
    with MetricsLogger(folder, tensorboard=False) as logger:
        logger.log(0, {"eval/accuracy": 0.25})
        for step in range(1, 6):
            logger.log(step, {"reward/mean": step / 5, "kl/ref": 0.01 * step, "time/step_s": 2.0, "train/flat": 1.0})
            logger.log_warnings(step, ["60% of completions hit max_new_tokens"] if step == 2 else [])
        logger.log(5, {"eval/accuracy": 0.75})
        if with_samples:
            scores = [0.0, 1.0, 0.5, None]
            logger.log_samples(5, [{"prompt": "p", "completion": f"c{i}", "reward": r} for i, r in enumerate(scores)])
            answers = [("sean", " naes.", 1.0, True), ("joel", " lej.", 0.0, False)]
            logger.log_eval_samples(
                5, [{"prompt": p, "completion": c, "reward": r, "correct": k} for p, c, r, k in answers]
            )


def test_the_page_goes_from_the_headline_to_the_detail(tmp_path):
    logged_run(tmp_path)
    page = write_report(tmp_path, title="run").read_text()
    assert headings(page) == [
        "Warnings (1)",
        "Summary",
        "Key curves",
        "Completions of step 5: best, median, worst",
        "Held-out answers at step 5: 1 of 2 right",
    ]
    assert "step 2: 60% of completions hit max_new_tokens" in page
    assert "held out, eval/accuracy</th><td>0.25 → 0.75 (step 0 → 5)" in page
    assert "reward, batch mean</th><td>0.2 → 1" in page and "training time</th><td>10.0 s" in page
    assert "Panels: reward, held-out evaluation, KL." in page  # the flat time and train/flat are no panel
    # best, median, worst of the last step: the unscored sample ranks lowest
    best, median, worst = re.findall(r"<td>(best|median|worst)</td><td>p</td><td>(c\d)</td>", page)
    assert (best[1], median[1], worst[1]) == ("c1", "c2", "c3")
    assert "<tr class='right'><td class='mark'>✓ right</td>" in page and "✗ wrong" in page
    assert "Constant throughout: time/step_s = 2, train/flat = 1." in page
    assert page.index("<details>") > page.index("Held-out answers")  # every metric comes last, folded


def test_no_section_is_left_empty(tmp_path):
    logged_run(tmp_path, with_samples=False)
    page = write_report(tmp_path, title="run", summary={"after SFT": 0.5, "baseline": None}).read_text()
    assert "Completions of step" not in page and "Held-out answers" not in page and "(none)" not in page
    assert "baseline" not in page  # a value the caller did not have is no row
    empty = tmp_path / "empty"
    empty.mkdir()
    assert headings(write_report(empty, title="nothing logged").read_text()) == []


def test_posttrain_report_rebuilds_the_page_with_what_its_writer_added(tmp_path, capsys):
    logged_run(tmp_path)
    write_report(tmp_path, title="the demo", summary={"after SFT": 0.5}, links={"RL stage": "rl/report.html"})
    first = (tmp_path / "report.html").read_text()
    (tmp_path / "report.html").unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").read_text() == first == rebuild_report(tmp_path).read_text()
    assert "<a href='rl/report.html'>RL stage</a>" in first and "after SFT" in first


def test_posttrain_report_of_a_folder_that_is_no_run_is_one_message(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a run directory" in err and "Traceback" not in err
    assert not (tmp_path / "report.html").exists()


def test_a_conversation_reads_a_turn_a_line_with_each_call_and_its_result(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"tools/calls_per_episode": 1.0, "reward/mean": 0.0})
        logger.log(2, {"tools/calls_per_episode": 2.0, "reward/mean": 1.0})
        conversation = [
            {"role": "assistant", "content": '<tool_call>{"name": "add"}</tool_call>'},
            {"role": "tool", "content": "5", "name": "add"},
            {"role": "assistant", "content": "It is 5."},
        ]
        logger.log_samples(2, [{"prompt": "What is 2 + 3?", "completion": conversation, "reward": 1.0}])
    page = write_report(tmp_path, title="tools").read_text()
    assert "[assistant] &lt;tool_call&gt;{&quot;name&quot;: &quot;add&quot;}&lt;/tool_call&gt;\n[tool add] 5\n" in page
    assert "Panels: reward, tool use." in page
