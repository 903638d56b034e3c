"""Configs you can read and compare: ``--print-config`` gives each value's origin and reads back as
the same config, ``--options`` shows a preset's values, ``posttrain diff`` lists exactly the keys
two presets, config files or run folders differ in."""

from __future__ import annotations

import itertools

import pytest
import yaml

from posttrain.cli import main
from posttrain.config import dump_config
from posttrain.train.rl_config import load_rl_config

RUN = ["--config", "configs/reverse_grpo.yaml", "algorithm=ppo", "steps=3", "algorithm.kl.coef=0.2"]


def leaves(tree, prefix=""):
    """Dotted leaf keys of a nested mapping (written here independently of config_view.flatten)."""
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def test_print_config_names_each_value_s_origin_and_reads_back_as_the_config(capsys):
    assert main(["rl", *RUN, "--print-config"]) == 0
    text = capsys.readouterr().out
    origin, path = {}, []
    for line in text.splitlines():
        body, _, source = line.partition("  # ")
        depth, name = (len(body) - len(body.lstrip())) // 2, body.strip().split(":")[0]
        path = [*path[:depth], name]
        if source:
            origin[".".join(path)] = source.strip()
    assert origin["steps"] == "command line" and origin["algorithm.kl.coef"] == "command line"
    assert origin["algorithm.advantage"] == "preset ppo" and origin["algorithm.advantage_options.lam"] == "preset ppo"
    assert origin["algorithm.critic.learning_rate"] == "preset ppo"
    assert origin["learning_rate"] == origin["data.task"] == "configs/reverse_grpo.yaml"
    assert origin["warmup_steps"] == origin["padding_free"] == origin["algorithm.kl.controller"] == "default"
    expected = load_rl_config("configs/reverse_grpo.yaml", RUN[2:]).model_dump(mode="json")
    assert yaml.safe_load(text) == expected


def option_rows(text: str) -> list[str]:
    """The rows of ``--options``: a wrapped meaning continues on lines that start with spaces."""
    return [line for line in text.splitlines() if line and not line[0].isspace()]


def test_options_show_a_preset_s_values_with_their_origin(capsys):
    assert main(["rl", "--options"]) == 0
    plain = {line.split()[0]: line.split()[1] for line in option_rows(capsys.readouterr().out)}
    assert main(["rl", "--options", "algorithm=ppo"]) == 0
    rows = {line.split()[0]: line.split()[1:4] for line in option_rows(capsys.readouterr().out)}
    assert plain["algorithm.advantage"] == "'grpo'"
    assert rows["algorithm.advantage"][:3] == ["gae", "preset", "ppo"]
    assert rows["algorithm.advantage_options"][:2] == ["{gamma:", "1.0,"]
    assert rows["steps"][1] == "default"


def diff_keys(capsys, *args):
    assert main(["diff", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    count = int(lines[0].split(": ")[1].split()[0])
    keys = [line.split()[0] for line in lines[1:]]
    assert len(keys) == count
    return set(keys)


@pytest.mark.parametrize("first, second", [("grpo", "dapo"), ("ppo", "reinforce_pp"), ("grpo", "one_step_off_policy")])
def test_diff_of_two_presets_lists_exactly_the_keys_that_differ(capsys, first, second):
    def resolved(name):
        config = load_rl_config(None, [f"algorithm={name}", "model.tiny={}", "data.task=reverse"])
        dumped = config.model_dump(mode="json")
        return leaves({"algorithm": dumped["algorithm"], "rollout": dumped["rollout"]})

    a, b = resolved(first), resolved(second)
    expected = {key for key in a.keys() | b.keys() if a.get(key, "absent") != b.get(key, "absent")}
    assert expected and diff_keys(capsys, first, second) == expected


def test_diff_of_run_folders_and_config_files(tmp_path, capsys):
    base = ["model.tiny={}", "data.task=reverse", "algorithm=grpo"]
    configs = {
        "one": load_rl_config(None, [*base, "steps=10"]),
        "two": load_rl_config(None, [*base, "steps=20", "learning_rate=3e-4", "sampling.top_p=0.9"]),
    }
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(dump_config(config))
    assert diff_keys(capsys, str(tmp_path / "one"), str(tmp_path / "two")) == {
        "steps", "learning_rate", "sampling.top_p"
    }  # fmt: skip
    same = diff_keys(capsys, "configs/reverse_grpo.yaml", "configs/reverse_grpo.yaml")
    assert same == set()
    assert diff_keys(capsys, "grpo", str(tmp_path / "one")) == set()  # a preset: its own sections only
    for a, b in itertools.permutations(["dapo", str(tmp_path / "two")]):
        assert "algorithm.dynamic_sampling.enabled" in diff_keys(capsys, a, b)


def test_diff_of_something_else_is_one_message(capsys):
    assert main(["diff", "no_such_thing", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "'no_such_thing' is not a run folder" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["rl", "sft", "rm", "dpo"])
def test_options_fit_120_columns_and_bare_words_filter_the_keys(capsys, command):
    """A newcomer's first hour, item 11: `posttrain rl --options kl` was refused as a malformed override,
    and 107 lines of `rl --options` ran past 120 columns."""
    assert main([command, "--options"]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 120
    assert main([command, "--options", "lr", "learning"]) == 0
    keys = [line.split()[0] for line in option_rows(capsys.readouterr().out)]
    assert keys and all("lr" in key or "learning" in key for key in keys)
    assert any(key == "learning_rate" for key in keys)


def test_rl_help_gives_an_rl_config_as_its_example(capsys):
    with pytest.raises(SystemExit):
        main(["rl", "--help"])
    assert "configs/reverse_grpo.yaml" in capsys.readouterr().out
