"""Config loading: YAML + dotted overrides, and errors that name the key and the valid choices."""

from __future__ import annotations

import itertools
from typing import Literal

import pytest
from pydantic import Field

from posttrain.cli import main
from posttrain.config import ConfigError, Section, describe, dump_config, load_config, parse_overrides


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model folder."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""


class ExampleConfig(Section):
    model: ModelSection = ModelSection()
    """The policy."""
    steps: int = Field(10, ge=1)
    """Optimizer steps."""
    learning_rate: float = Field(1e-3, gt=0)
    """AdamW learning rate."""
    rewards: list[str] = Field(default_factory=lambda: ["reverse"])
    """Reward function names or pkg.module:fn paths."""


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_file_then_overrides(tmp_path):
    path = write(tmp_path, "model:\n  path: out/sft\nsteps: 5\n")
    config = load_config(ExampleConfig, path, ["steps=7", "model.dtype=bfloat16", "rewards=[a, 'pkg.m:fn']"])
    assert config.model.path == "out/sft" and config.model.dtype == "bfloat16"
    assert config.steps == 7 and config.rewards == ["a", "pkg.m:fn"]
    assert config.learning_rate == 1e-3


def test_dump_round_trips(tmp_path):
    config = load_config(ExampleConfig, None, ["steps=3"])
    again = load_config(ExampleConfig, write(tmp_path, dump_config(config)))
    assert again == config


def test_docs_come_from_field_docstrings():
    rows = {key: (default, doc) for key, default, doc in describe(ExampleConfig)}
    assert rows["model.path"] == ("None", "A local Hugging Face model folder.")
    assert rows["learning_rate"] == ("0.001", "AdamW learning rate.")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["stpes=3"],
            "unknown key 'stpes'; valid keys here: learning_rate, model, rewards, steps. Did you mean 'steps'?",
        ),
        (["model.pth=x"], "Did you mean 'model.path'?"),
        (["model.dtype=fp32"], "model.dtype = 'fp32': Input should be 'float32' or 'bfloat16'"),
        (["steps=0"], "steps = 0: Input should be greater than or equal to 1"),
        (["steps=many"], "steps = 'many': Input should be a valid integer"),
        (["learning_rate=-1"], "learning_rate = -1: Input should be greater than 0"),
        (["rewards=reverse"], "rewards = 'reverse': Input should be a valid list"),
        (["model=3"], "model = 3"),
    ],
)
def test_bad_values_are_named_with_valid_choices(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(ExampleConfig, None, overrides)
    assert expected in str(error.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError, match=r"3 problem\(s\)"):
        load_config(ExampleConfig, None, ["stpes=3", "model.dtype=fp8", "learning_rate=0"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("- a\n- b\n", "must hold a mapping"), ("a: [1, 2\n", "not valid YAML")],
)
def test_bad_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(ExampleConfig, write(tmp_path, text))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ExampleConfig, tmp_path / "missing.yaml")


def test_a_key_written_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    # PyYAML keeps the last of two equal keys silently: a config with `model:` twice lost the first
    text = "steps: 3\nmodel: a\nlearning_rate: 0.1\nmodel:\n  path: b\n"
    with pytest.raises(ConfigError, match=r"'model' is written twice \(lines 2 and 4\)"):
        load_config(ExampleConfig, write(tmp_path, text))
    nested = "model:\n  path: a\n  path: b\n"
    with pytest.raises(ConfigError, match=r"'path' is written twice"):
        load_config(ExampleConfig, write(tmp_path, nested))
    with pytest.raises(ConfigError, match=r"'a' is written twice"):
        parse_overrides(["model={a: 1, a: 2}"])


def test_override_syntax():
    assert parse_overrides(["a.b.c=1", "a.b.d=[x]", "e="]) == {"a": {"b": {"c": 1, "d": ["x"]}}, "e": None}
    with pytest.raises(ConfigError, match=r"dotted\.key=value"):
        parse_overrides(["steps"])
    with pytest.raises(ConfigError, match="conflicts"):
        parse_overrides(["a=1", "a.b=2"])


def test_exponent_floats_are_numbers_in_files_and_overrides(tmp_path):
    # PyYAML alone reads 1e-6 and 1.0e9 as strings: inside a free-form mapping (loss_options)
    # the string reached the loss and failed mid-run
    parsed = parse_overrides(["o={a: 1e-6, b: 1.0e9, c: -2E3, d: .5e1, e: 1_000, f: 1e, g: e5, h: '1e3'}"])
    assert parsed["o"] == {"a": 1e-6, "b": 1e9, "c": -2000.0, "d": 5.0, "e": 1000, "f": "1e", "g": "e5", "h": "1e3"}
    assert all(isinstance(parsed["o"][k], float) for k in "abcd")
    path = write(tmp_path, "learning_rate: 3e-4\nsteps: 2\n")
    assert load_config(ExampleConfig, str(path), []).learning_rate == 3e-4


def alias_bomb(levels: int = 8) -> str:
    """'Billion laughs': level i holds nine aliases of level i - 1, 9**levels values once expanded."""
    names = [chr(ord("a") + i) for i in range(levels + 1)]
    lines = [
        "data:",
        "  task: reverse",
        "  task_options:",
        f"    {names[0]}: &{names[0]} [lol, lol, lol, lol, lol, lol, lol, lol, lol]",
    ]
    lines += [f"    {new}: &{new} [{', '.join([f'*{old}'] * 9)}]" for old, new in itertools.pairwise(names)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_within_2_seconds_and_200_mb(tmp_path):
    """Issue 45, item 2: it was expanded before any key was checked, until memory ran out."""
    import time
    import tracemalloc

    from posttrain.train.rl_config import load_rl_config

    file = tmp_path / "bomb.yaml"
    file.write_text(alias_bomb())
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ConfigError, match=r"bomb\.yaml.*expands to more than 100,000 values"):
            load_rl_config(str(file), [])
        with pytest.raises(ConfigError, match="expands to more than"):
            load_rl_config(
                None,
                [
                    "data.task_options="
                    + "{a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b ["
                    + ", ".join(["*a"] * 10)
                    + "], c: &c ["
                    + ", ".join(["*b"] * 10)
                    + "], d: &d ["
                    + ", ".join(["*c"] * 10)
                    + "], e: ["
                    + ", ".join(["*d"] * 10)
                    + "]}"
                ],
            )
        elapsed, peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0 and peak < 200e6


DEEP = {
    "flow": "data:\n  task_options: " + "[" * 20_000 + "]" * 20_000 + "\n",
    "block": "data:\n" + "".join(" " * (2 + level) + f"k{level}:\n" for level in range(5_000)),
}


@pytest.mark.parametrize("shape", sorted(DEEP))
def test_a_config_nested_thousands_deep_is_one_message(tmp_path, capsys, shape):
    """Hardening 3, item 9: PyYAML's recursion ran out of stack (a RecursionError traceback)."""
    file = tmp_path / "deep.yaml"
    file.write_text(DEEP[shape])
    assert main(["rl", "--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "deep.yaml" in err and "nests values thousands of levels deep" in err
    assert main(["rl", "data.task_options=" + "[" * 20_000]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "20,018 characters" in err and len(err) < 600


def test_anchors_and_merge_keys_of_a_normal_config_still_load(tmp_path):
    from posttrain.config import load_yaml

    text = "base: &base {temperature: 0.7, top_p: 0.9}\nrun:\n  <<: *base\n  top_p: 1.0\nalso: *base\n"
    assert load_yaml(text) == {
        "base": {"temperature": 0.7, "top_p": 0.9},
        "run": {"temperature": 0.7, "top_p": 1.0},
        "also": {"temperature": 0.7, "top_p": 0.9},
    }
    assert load_yaml("a: &a [1, 2]\nb: [*a, *a]\n") == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
    with pytest.raises(Exception, match="expands to more than"):
        load_yaml("a: &a [1, *a]\n")  # refers to itself: infinite once expanded


def test_an_empty_mapping_clears_what_a_preset_set():
    """A newcomer's first hour, defect 4: `algorithm.loss_options={}` merged into PPO's {clip_low: 0.2},
    so switching the loss to pg was refused with "'pg' has no option clip_low"."""
    from posttrain.train.rl_config import load_rl_config

    base = ["model.tiny.layers=1", "data.task=reverse", "algorithm=ppo"]
    assert load_rl_config(None, base).algorithm.loss_options == {"clip_low": 0.2}
    config = load_rl_config(None, [*base, "algorithm.policy_loss=pg", "algorithm.loss_options={}"])
    assert config.algorithm.policy_loss == "pg" and config.algorithm.loss_options == {}
    # a non-empty mapping still merges key by key
    merged = load_rl_config(None, [*base, "algorithm.loss_options={clip_high: 0.28}"]).algorithm.loss_options
    assert merged == {"clip_low": 0.2, "clip_high": 0.28}


def test_a_preset_on_the_command_line_says_it_replaces_the_files_algorithm_section(tmp_path, capsys):
    """A newcomer's first hour, item 9: `algorithm=rloo` drops the file's whole algorithm section
    (its KL settings with it) without a word."""
    from posttrain.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("algorithm:\n  preset: grpo\n  kl:\n    coef: 0.05\n    placement: loss\nsteps: 2\n")
    base = ["rl", "--config", str(config), "model.tiny.layers=1", "data.task=reverse", f"output_dir={tmp_path / 'r'}"]
    assert main([*base, "algorithm=rloo", "--plan"]) == 0
    assert f"note    algorithm: preset rloo replaces {config}'s algorithm section" in capsys.readouterr().out
    assert main([*base, "algorithm.kl.coef=0.1", "--plan"]) == 0  # an override of a key replaces nothing
    assert "replaces" not in capsys.readouterr().out
