"""data.filter (data/difficulty.py): before training, the starting policy samples k completions of
every training prompt and only the prompts it solves sometimes are kept; the rates are written to
the run folder and a resume reads them instead of measuring again."""

from __future__ import annotations

import json

import pytest

from posttrain.config import ConfigError
from posttrain.data.difficulty import filter_rows
from posttrain.data.loading import DataError
from posttrain.run.run_dir import RunDirError
from posttrain.sources.recorded import read_batch
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
RUN = [*TINY, "data.task=reverse", "data.n_train=24", "data.n_eval=9", "eval_size=0", "prompts_per_step=2",
       "samples_per_prompt=4", "max_new_tokens=4", "reward_workers=0", "preflight=false", "log_every=100",
       "algorithm=grpo", "steps=3", "record_rollouts=true", "data.filter.pass_rate=[0.1, 0.9]",
       "data.filter.k=8"]  # fmt: skip
MEASURED = 24 * 8  # the filter scores every training prompt's k samples in one call


def kind(name: str) -> str:
    """Which prompts always pass, never pass, or pass by chance under ``by_name``."""
    if name[0] in "aeiou":
        return "always"
    return "never" if len(name) % 2 else "chance"


def by_name(prompts, completions, completion_ids, name, **columns):
    by_name.calls.append(len(completions))
    scores = {"always": lambda text: 1.0, "never": lambda text: 0.0, "chance": lambda text: float(len(set(text)) % 2)}
    return [scores[kind(n)](text) for n, text in zip(name, completions, strict=True)]


def make_run(tmp_path, *overrides, name="run"):
    by_name.calls = []
    config = load_rl_config(None, [*RUN, f"output_dir={tmp_path / name}", *overrides])
    return OnlineRL(config, reward_functions=[by_name], echo=lambda line: None)


def test_only_the_prompts_solved_sometimes_are_trained_on(tmp_path):
    run = make_run(tmp_path)
    assert by_name.calls == [MEASURED]
    rates = run.data_filter.rates
    names = [row["name"] for row in run_rows(tmp_path)]
    kinds = [kind(n) for n in names]
    assert {"always", "never", "chance"} <= set(kinds)  # the data holds every kind
    assert all(rate == 1.0 for rate, k in zip(rates, kinds, strict=True) if k == "always")
    assert all(rate == 0.0 for rate, k in zip(rates, kinds, strict=True) if k == "never")
    kept = {names[i] for i in run.data_filter.kept}
    assert kept and all(kind(n) == "chance" for n in kept)
    assert [row["name"] for row in run.rows] == [n for n in names if n in kept]
    run.run()
    record = json.loads((tmp_path / "run" / "data_filter.json").read_text())
    assert record["rates"] == rates and record["kept"] == run.data_filter.kept
    assert sum(record["histogram"].values()) == 24
    for step in (1, 2, 3):
        batch, _ = read_batch(tmp_path / "run" / "rollouts", step)
        assert {name for name in batch.columns["name"]} <= kept


def run_rows(tmp_path):
    from posttrain.data.section import load_rows

    return load_rows(load_rl_config(None, [*RUN, f"output_dir={tmp_path / 'x'}"]).data, 0)[0]


def test_a_resume_reads_the_measured_rates_and_refuses_other_settings(tmp_path):
    first = make_run(tmp_path, "save_every=1")
    first.run()
    resumed = make_run(tmp_path, "save_every=1", "steps=4", "resume=auto")
    assert by_name.calls == []  # nothing measured again: the policy has moved since
    assert resumed.data_filter.rates == first.data_filter.rates
    # other filter settings are another data set: refused like any data change on resume
    with pytest.raises(RunDirError, match=r"data\.filter\.k: 8 then, 4 now"):
        make_run(tmp_path, "save_every=1", "steps=4", "resume=auto", "data.filter.k=4")
    # and by the filter itself when the folder's rates do not match the settings
    settings = load_rl_config(None, [*RUN, "data.filter.k=4"]).data.filter
    with pytest.raises(DataError, match=r"data_filter\.json was measured with k=8.*k=4"):
        filter_rows(run_rows(tmp_path), settings, None, tmp_path / "run", resuming=True)


def test_too_few_kept_prompts_are_refused_with_the_histogram(tmp_path):
    with pytest.raises(DataError, match=r"data\.filter kept 0 prompts.*widen data\.filter\.pass_rate"):
        make_run(tmp_path, "data.filter.pass_rate=[0.95, 0.99]")


def test_bad_filter_settings_are_refused():
    with pytest.raises(ConfigError, match=r"data\.filter\.pass_rate"):
        load_rl_config(None, [*RUN, "data.filter.pass_rate=[0.9, 0.1]"])
    with pytest.raises(ConfigError, match=r"data\.filter\.pass_rate"):
        load_rl_config(None, [*RUN, "data.filter.pass_rate=[0.1, 1.5]"])
