"""A run that stops on an error still writes ``report.html`` (issue 23, item 10): what it logged up
to the failure, headed by why it stopped; the error itself still reaches the user as one message."""

from __future__ import annotations

from posttrain.cli import main
from posttrain.telemetry.metrics import read_jsonl

from .resume_cases import overrides, rows_with_dead_steps, vowel_share_if_live, write_rows


def vowels_until_a_dead_row(prompts, completions, completion_ids, live, **columns):
    """Scores like ``vowel_share_if_live`` but raises on the rows of a "dead" step: a broken
    reward function that works for the first steps."""
    if not all(live):
        raise ValueError("the scoring service went away")
    return vowel_share_if_live(prompts, completions, completion_ids, live)


def test_an_rl_run_that_fails_at_step_3_reports_its_first_two_steps_and_why(tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", rows_with_dead_steps({3}, 4))
    run = tmp_path / "run"
    reward = "rewards=[tests.train.test_failure_report:vowels_until_a_dead_row]"
    assert main(["rl", *overrides(data, run, 4, ["preflight=false", reward])]) == 2
    err = capsys.readouterr().err
    assert "vowels_until_a_dead_row" in err and "the scoring service went away" in err
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    report = (run / "report.html").read_text()
    assert "(stopped)" in report and "The run stopped" in report and "the scoring service went away" in report
    assert "<th>steps</th><td>2</td>" in report  # the summary: what was logged before the failure


def test_an_sft_run_that_diverges_reports_why(tmp_path, capsys):
    run = tmp_path / "run"
    tiny = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse"]
    # a rate this large sends the loss to inf/NaN within a few steps
    args = [*tiny, "data.n_train=32", "data.n_eval=9", "eval_size=0", "batch_size=4", "steps=50"]
    assert main(["sft", *args, "learning_rate=1e30", "max_grad_norm=null", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "step 2: the loss is nan" in err and "Lower learning_rate" in err
    report = (run / "report.html").read_text()
    assert "(stopped)" in report and "TrainingDiverged" in report
