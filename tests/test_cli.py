import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.cli import build_parser, demo_rl_overrides, main
from posttrain.data.tasks.reverse import make_rows, reverse_reward, split_names
from posttrain.demo import DemoConfig
from posttrain.evaluate import evaluate
from posttrain.telemetry.metrics import read_jsonl


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
    for flag in ("--seed", "--output-dir", "--rl-steps", "--sft-max-steps", "--no-baseline", "--threads"):
        assert flag in demo_help.stdout


def test_no_command_prints_help_and_fails():
    result = run_cli()
    assert result.returncode == 2 and "commands" in result.stdout


def test_demo_flag_defaults_match_demo_config():
    args = build_parser().parse_args(["demo"])
    defaults = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    for name in ("seed", "output_dir", "sft_max_steps", "threads"):
        assert getattr(args, name) == defaults[name], name
    assert args.no_baseline is (not defaults["baseline"])
    assert demo_rl_overrides(args) == [] == list(defaults["rl"])  # the RL stage is demo_rl.yaml as shipped


def test_demo_rl_flags_are_overrides_of_the_rl_stage_config(tmp_path):
    from posttrain.demo import rl_stage_config

    args = build_parser().parse_args(["demo", "--rl-steps", "40", "--max-staleness", "2", "--interrupt",
                                      "learning_rate=3e-4", "steps=50"])  # fmt: skip
    config = rl_stage_config(DemoConfig(output_dir=str(tmp_path), rl=tuple(demo_rl_overrides(args))), tmp_path / "rl")
    assert (config.steps, config.learning_rate, config.rollout.max_staleness, config.rollout.interrupt) == (
        50, 3e-4, 2, True,
    )  # fmt: skip
    shipped = rl_stage_config(DemoConfig(output_dir=str(tmp_path)), tmp_path / "rl")
    assert (shipped.steps, shipped.algorithm.preset, shipped.lr_scheduler, shipped.seed) == (600, "grpo", "cosine", 0)


def test_demo_interrupt_without_staleness_is_refused_before_any_stage(tmp_path):
    result = run_cli("demo", "--interrupt", "--output-dir", "out", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "rollout.interrupt" in result.stderr and "max_staleness >= 1" in result.stderr
    assert not (tmp_path / "out").exists()  # no stage ran
    result = run_cli("demo", "algorithm.advantage=grpp", "--output-dir", "out", cwd=tmp_path)
    assert result.returncode == 2 and "Did you mean 'grpo'" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flag", ["--rl-steps=-5", "--sft-max-steps=0", "--threads=0", "--max-staleness=-1", "--seed=x"]
)
def test_a_demo_flag_out_of_range_is_refused_naming_it_before_any_stage(tmp_path, flag):
    """Issue 45, item 3: --rl-steps -5 ran SFT for minutes, then ended in a pydantic error on 'steps'."""
    result = run_cli("demo", flag, "--output-dir", "out", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument {flag.split('=')[0]}:" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shortened_demo_runs_every_stage_and_rl_raises_the_reward(tmp_path):
    """The README's main command with a tiny budget: SFT stops early, GRPO runs, the baseline runs,
    the report is written; the sampled reward rises over the RL steps."""
    result = run_cli(
        "demo", "--rl-steps", "40", "--sft-max-steps", "150", "--output-dir", "out", "--threads", "2", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Test Set Exact Match Accuracy:") == 2
    assert result.stdout.count("Manual Examples Accuracy: ") == 2 and "sean     → " in result.stdout
    run = tmp_path / "out"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == 40 and summary["sft"]["steps"] <= 150
    # the accuracies reported are what the saved models score on the held-out names, evaluated here
    held_out = make_rows(split_names(1, summary["config"]["n_test"], seed=summary["config"]["seed"])[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the demo evaluated (--threads 2): other counts can flip a near-tie
    try:
        for key, folder in (("accuracy_after_sft", "sft"), ("accuracy_after_rl", "rl")):
            saved = run / folder / "final"
            model, tokenizer = AutoModelForCausalLM.from_pretrained(saved), AutoTokenizer.from_pretrained(saved)
            assert summary[key] == evaluate(model, tokenizer, held_out, reverse_reward).accuracy, key
    finally:
        torch.set_num_threads(threads)
    assert summary["accuracy_after_sft"] > 0  # 150 SFT steps learn some names: the comparison above is not 0 == 0
    continued = read_jsonl(run / "sft_continued" / "metrics.jsonl")
    assert summary["accuracy_sft_continued"] == [r["eval/accuracy"] for r in continued if "eval/accuracy" in r][-1]

    rl_metrics = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in rl_metrics if "reward/mean" in m]
    assert len(rewards) == 40
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10, rewards
    for name in ("report.html", "demo_comparison.png", "rl/report.html", "sft/metrics.jsonl"):
        assert (run / name).is_file(), name

    model = AutoModelForCausalLM.from_pretrained(run / "rl" / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "rl" / "final")
    ids = tokenizer("Reverse the name: sean. Answer:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_overrides_may_follow_a_flag(tmp_path):
    """Issue 45, item 5: `... --resume auto output_dir=x` was 'unrecognized arguments'."""
    from posttrain.cli import main
    from tests.cli.bad_inputs import BASE

    head, tail = BASE["sft"][:4], BASE["sft"][4:]
    assert main([*head, "--resume", "auto", *tail, "steps=1", "save_every=0", f"output_dir={tmp_path / 'run'}"]) == 0
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    with pytest.raises(SystemExit) as refused:
        main([*BASE["sft"], "--resume", "auto", "not-an-override"])
    assert refused.value.code == 2


def test_a_reader_that_goes_away_does_not_stop_training(tmp_path):
    """Issue 45, item 5: `posttrain sft ... | head -1` killed training at its next print (no final/)."""
    from tests.cli.bad_inputs import BASE

    argv = [*BASE["sft"], "steps=20", "log_every=1", "eval_every=5", "eval_size=9", f"output_dir={tmp_path / 'run'}"]
    child = subprocess.Popen([sys.executable, "-m", "posttrain", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.readline()
    child.stdout.close()  # the reader goes away, as `head -1` does
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err.decode()[-2000:]
    assert (tmp_path / "run" / "final" / "config.json").is_file()


@pytest.mark.parametrize("command", [["eval", "--model", "x", "--task", "reverse"], ["demo", "--rl-steps", "1"]])
def test_a_command_without_data_parallel_under_torchrun_is_one_message(command, monkeypatch, tmp_path, capsys):
    """A newcomer's first hour, defect 6: distributed.single_process_only was never called, so torchrun
    started N copies of eval or the demo, each writing the same files."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "not a data parallel command yet" in err and f"python -m posttrain {command[0]}" in err
    assert not any(tmp_path.iterdir())  # nothing was written


STARTING_CONFIG = {"rl": "configs/reverse_grpo.yaml", "sft": "configs/reverse_sft.yaml", "dpo": "configs/rlhf_dpo.yaml"}


@pytest.mark.parametrize("command", sorted(STARTING_CONFIG))
def test_a_command_without_a_model_or_data_says_what_is_missing_in_words(command, capsys):
    """A newcomer's first hour, item 11: `posttrain rl steps=3` said `model = a mapping: Field required`."""
    assert main([command, "steps=3"]) == 2
    err = capsys.readouterr().err
    assert "Field required" not in err and "Traceback" not in err
    assert "model is missing: " in err and "data is missing: " in err
    assert f"--config {STARTING_CONFIG[command]}" in err and "model.path=" in err and "data.path=" in err
