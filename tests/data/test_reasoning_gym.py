"""reasoning-gym as a data source (data.task: reasoning_gym:<name>) and its scorer as a reward."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.data import DataError
from posttrain.data.tasks import get_task
from posttrain.data.tasks.reasoning_gym import require_reasoning_gym, seeds
from posttrain.rewards import resolve_reward

pytest.importorskip("reasoning_gym", reason="reasoning-gym is a dev dependency (pip install -e '.[dev]')")

TASKS = ["gsm_symbolic", "basic_arithmetic", "chain_sum"]


def score(rows, completions):
    columns = {"reasoning_gym_entry": [row["reasoning_gym_entry"] for row in rows]}
    return resolve_reward("reasoning_gym").fn([row["prompt"] for row in rows], completions, None, **columns)


@pytest.mark.parametrize("name", TASKS)
def test_rows_are_deterministic_and_held_out_problems_never_train(name):
    task = get_task(f"reasoning_gym:{name}")
    data, again, other = task(60, 30, 0), task(60, 30, 0), task(60, 30, 1)
    assert data == again and data.train != other.train
    assert len(data.train) == 60 and len(data.held_out) == 30
    assert not {r["prompt"] for r in data.train} & {r["prompt"] for r in data.held_out}
    assert data.reward == "reasoning_gym"
    assert seeds(0)[0] != seeds(0)[1]  # the two splits come from different generator seeds
    entry = json.loads(data.train[0]["reasoning_gym_entry"])
    assert entry["question"] == data.train[0]["prompt"] and str(entry["answer"]) == data.train[0]["answer"]


def test_run_seeds_draw_different_problems():
    # reasoning-gym seeds item i of a dataset with Random(seed + i): datasets of nearby seeds are
    # shifted copies, so run seeds 0 and 1 (generator seeds 1, 2 and 3, 4) shared 298 of 300
    # held-out problems and nearly every training problem
    task = get_task("reasoning_gym:basic_arithmetic", {"max_terms": 3, "max_digits": 2})
    runs = [task(300, 300, seed) for seed in (0, 1, 2)]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        for split in ("train", "held_out"):
            shared = {r["prompt"] for r in getattr(runs[a], split)} & {r["prompt"] for r in getattr(runs[b], split)}
            assert len(shared) <= 15, (a, b, split, len(shared))  # chance repeats of easy problems only
    assert len(set(seeds(0) + seeds(1) + seeds(2))) == 6 and all(0 <= s < 2**31 for s in seeds(123))


@pytest.mark.parametrize("name", TASKS)
def test_the_tasks_scorer_reads_answers_like_the_math_reward(name):
    rows = get_task(f"reasoning_gym:{name}")(0, 6, 3).held_out
    answers = [row["answer"] for row in rows]
    assert score(rows, [f"<think> easy </think><answer> {a} </answer>" for a in answers]) == [1.0] * 6
    assert score(rows, [f"so the result is \\boxed{{{a}}}" for a in answers]) == [1.0] * 6
    assert score(rows, ["I cannot tell."] * 6) == [0.0] * 6
    wrong = score(rows, [f"<answer> {a}1 </answer>" for a in answers])
    assert all(value < 1.0 for value in wrong)


def test_gsm_symbolic_ships_a_worked_solution_for_cold_start_sft():
    row = get_task("reasoning_gym:gsm_symbolic")(3, 0, 0).train[0]
    assert row["completion"].startswith("<think> ") and row["completion"].endswith(
        f"<answer> {row['answer']} </answer>"
    )


def test_task_options_reach_the_generator_and_bad_ones_are_named():
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False}
    rows = get_task("reasoning_gym:basic_arithmetic", options)(20, 0, 0).train
    numbers = [re.findall(r"\d+", row["prompt"]) for row in rows]
    # two small operands, where the defaults also give e.g. "Calculate -5229 * 9218."
    assert all(len(n) == 2 and all(int(d) <= 10 for d in n) for n in numbers), [row["prompt"] for row in rows]
    with pytest.raises(ValueError, match=r"bad data.task_options \{'bogus': 1\}"):
        get_task("reasoning_gym:basic_arithmetic", {"bogus": 1})(2, 0, 0)
    with pytest.raises(DataError, match="did you mean gsm_symbolic"):
        get_task("reasoning_gym:gsm_symbolc")(2, 0, 0)
    with pytest.raises(ValueError, match="task_options only apply"):
        get_task("reverse", {"difficulty": 1})


def test_a_missing_package_gives_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[tasks\]'"):
        require_reasoning_gym()


def test_an_rl_run_trains_on_a_reasoning_gym_task(tmp_path):
    from posttrain.train.rl import OnlineRL
    from posttrain.train.rl_config import load_rl_config

    config = load_rl_config(
        None,
        [
            "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2",
            "data.task=reasoning_gym:basic_arithmetic", "data.task_options={min_terms: 2, max_terms: 2}",
            "data.n_train=32", "data.n_eval=8", "eval_size=8", "steps=2", "prompts_per_step=4",
            "samples_per_prompt=2", "max_new_tokens=4", "reward_workers=0", "allow_constant_reward=[reasoning_gym]",
            f"output_dir={tmp_path / 'run'}",
        ],
    )  # fmt: skip
    history = OnlineRL(config, echo=lambda line: None).run()
    assert len(history) == 2 and "reward/reasoning_gym/mean" in history[0]
    assert "eval/reward" in history[-1]
