"""data.curriculum (issue 22, item 2; issue 36: over any column): levels of a reasoning-gym task's
options, or values or ranges of a data column, easiest first; each
step draws from the current level, which advances when the batch pass rate stays at advance_at
for window steps; held-out rows are the last level's; a resumed run continues on its level."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.data.curriculum import LEVEL_COLUMN, CurriculumSection, curriculum_rows, row_levels
from posttrain.data.loading import DataError
from posttrain.data.sampler import CurriculumSampler
from posttrain.distributed import World
from posttrain.run.checkpoint import checkpoint_root
from posttrain.train.rl_config import load_rl_config

ONE_PROCESS = World()
SHORT, LONG = {"min_words": 1, "max_words": 1}, {"min_words": 4, "max_words": 6}
seen_levels: list[int] = []


def level_zero_passes(prompts, completions, completion_ids, curriculum_level, **columns):
    """1 for every sample drawn from level 0, 0 above it: level 0 is passed at once, level 1 never."""
    seen_levels.extend(
        curriculum_level if len(completions) == 8 else []
    )  # a step's batch (4 × 2), not the evaluation (4)
    return [1.0 if level == 0 else 0.0 for level in curriculum_level]


def scores(*values: float) -> torch.Tensor:
    return torch.tensor(values)


def test_the_sampler_draws_the_current_level_and_advances_on_the_windows_pass_rate():
    section = CurriculumSection(levels=[{}, {}, {}], advance_at=0.5, window=2)
    levels = [0, 1, 2] * 6  # interleaved: indices say which level a row belongs to
    sampler = CurriculumSampler(levels, batch_size=2, seed=0, section=section)
    assert all(levels[i] == 0 for i in sampler.next_batch())
    assert sampler.observe(scores(1.0, 1.0), ONE_PROCESS) == {"curriculum/level": 0.0, "curriculum/pass_rate": 1.0}
    assert sampler.level == 0  # one step is not a window of 2, however good
    sampler.observe(scores(0.0, 0.0, 0.0, 0.0), ONE_PROCESS)  # window mean 0.5: advance, from the next step on
    assert sampler.level == 0 and all(levels[i] == 0 for i in sampler.next_batch())  # this step's further draws
    sampler.start_step()
    assert sampler.level == 1 and all(levels[i] == 1 for i in sampler.next_batch())
    sampler.observe(scores(1.0, float("nan")), ONE_PROCESS)  # an unscored sample does not pass
    assert sampler.observe(scores(0.0, 0.0), ONE_PROCESS)["curriculum/pass_rate"] == 0.0
    assert sampler.level == 1  # mean 0.25 < 0.5
    state = sampler.state_dict()
    copy = CurriculumSampler(levels, batch_size=2, seed=0, section=section)
    copy.load_state_dict(state)
    assert [copy.next_batch() for _ in range(4)] == [sampler.next_batch() for _ in range(4)]
    for _ in range(6):
        sampler.start_step()
        sampler.observe(scores(1.0), ONE_PROCESS)
        sampler.start_step()
    assert sampler.level == 2  # the last level is kept
    with pytest.raises(DataError, match="level 1 has 1 usable rows, fewer than one step's batch"):
        CurriculumSampler([0, 0, 1, 2, 2], batch_size=2, seed=0, section=section)


def test_rows_of_every_level_are_tagged_and_held_out_rows_come_from_the_last_one():
    pytest.importorskip("reasoning_gym")
    from posttrain.data.tasks import get_task

    section = CurriculumSection(levels=[SHORT, LONG])
    train, held_out, reward = curriculum_rows(
        lambda options: get_task("reasoning_gym:letter_counting", options), section, {}, 20, 10, 3
    )
    assert reward == "reasoning_gym" and len(held_out) == 10
    assert [row[LEVEL_COLUMN] for row in train] == [0] * 20 + [1] * 20

    def words(row):  # the text whose letters are counted, between the last pair of quotes
        return len(row["prompt"].rsplit('"', 2)[1].split())

    assert {words(row) for row in train[:20]} == {1}
    assert all(4 <= words(row) <= 6 for row in train[20:] + held_out)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in held_out}
    assert {row[LEVEL_COLUMN] for row in held_out} == {1}


def test_a_curriculum_is_refused_where_it_cannot_apply():
    base = ["model.tiny.layers=1", "data.curriculum.levels=[{}, {}]"]
    with pytest.raises(ConfigError, match=re.escape("data.curriculum without a column varies data.task_options")):
        load_rl_config(None, [*base, "data.task=reverse"])
    with pytest.raises(ConfigError, match=re.escape("data.curriculum.levels = [{}]: List should have at least 2")):
        load_rl_config(None, [*base, "data.task=reasoning_gym:letter_counting", "data.curriculum.levels=[{}]"])
    column = ["model.tiny.layers=1", "data.task=reverse", "data.curriculum.column=difficulty"]
    with pytest.raises(ConfigError, match=re.escape("a range of column 'difficulty' is {min: ..., max: ...}")):
        load_rl_config(None, [*column, "data.curriculum.levels=[{low: 1}, 2]"])
    with pytest.raises(ConfigError, match=re.escape("levels[1] = 2: without data.curriculum.column")):
        load_rl_config(None, ["model.tiny.layers=1", "data.task=reasoning_gym:letter_counting",
                              "data.curriculum.levels=[{}, 2]"])  # fmt: skip
    # a curriculum under max_staleness advances on the batches produced (sources/curriculum.py): no refusal
    asynchronous = [*base, "data.task=reasoning_gym:letter_counting", "rollout.max_staleness=1"]
    assert load_rl_config(None, asynchronous).data.curriculum is not None


def test_levels_of_a_column_are_values_lists_or_ranges():
    section = CurriculumSection(column="difficulty", levels=["easy", [1, 2], {"min": 3, "max": 5}, {"min": 6}])
    rows = [{"difficulty": v} for v in ("easy", 2, 1, 3, 5, 4.5, 9, 0, "hard", None)] + [{}]
    assert row_levels(rows, section) == [0, 1, 1, 2, 2, 2, 3, None, None, None, None]
    # rows of no level are never drawn; a level short of rows names the column and the level
    sampler = CurriculumSampler(row_levels(rows[:7] * 2, section), batch_size=2, seed=0, section=section)
    assert all(row_levels([(rows[:7] * 2)[i]], section) == [0] for i in sampler.next_batch())
    with pytest.raises(DataError, match=r"level 0 has 1 rows whose 'difficulty' is 'easy'"):
        CurriculumSampler(row_levels(rows, section), batch_size=2, seed=0, section=section)


def test_an_rl_run_moves_up_a_level_and_a_resumed_run_stays_there(tmp_path):
    pytest.importorskip("reasoning_gym")
    from posttrain.train.rl import OnlineRL

    common = [
        "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2",
        "data.task=reasoning_gym:letter_counting", f"data.curriculum.levels=[{SHORT}, {LONG}]".replace("'", ""),
        "data.curriculum.window=2", "data.curriculum.advance_at=0.9", "data.n_train=16", "data.n_eval=4",
        "eval_size=4", "steps=4", "prompts_per_step=4", "samples_per_prompt=2", "max_new_tokens=4",
        "reward_workers=0", "rewards=[tests.data.test_curriculum:level_zero_passes]", "algorithm=grpo",
        "allow_constant_reward=[level_zero_passes]", "save_every=1", "keep_last=4", "preflight=false",
    ]  # fmt: skip
    seen_levels.clear()
    history = OnlineRL(load_rl_config(None, [*common, f"output_dir={tmp_path / 'run'}"]), echo=lambda _: None).run()
    # two steps passed at level 0 (a window of 2), then level 1 for good
    assert [h["curriculum/level"] for h in history] == [0.0, 0.0, 1.0, 1.0]
    assert [h["curriculum/pass_rate"] for h in history] == [1.0, 1.0, 0.0, 0.0]
    assert seen_levels == [0] * 16 + [1] * 16
    # resumed from the checkpoint after step 2 (the level advanced there), it draws level 1 at once
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed_dir)
    shutil.rmtree(resumed_dir / "final")
    for path in checkpoint_root(resumed_dir).iterdir():
        if int(path.name.split("-")[1]) > 2:
            shutil.rmtree(path)
    seen_levels.clear()
    config = load_rl_config(None, [*common, f"output_dir={resumed_dir}", "resume=auto"])
    resumed = OnlineRL(config, echo=lambda _: None).run()
    assert [h["curriculum/level"] for h in resumed] == [1.0, 1.0] and seen_levels == [1] * 16
