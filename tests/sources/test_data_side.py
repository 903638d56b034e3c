"""The data-side features over environment episodes (issue 36, item 3): dynamic sampling, overlong
shaping, ReMax's greedy baseline, the difficulty filter and a curriculum over a data column each
wrap the environment source as they wrap single-turn completions, and each takes effect.

The environment (``data_side_envs.FlatOrCoin``) makes the effect visible: a "flat" row's
episodes all return 1, a "coin" row's return the parity of an answer's length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.algos import overlong_reward_penalty
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

from .data_side_envs import rows

pytestmark = pytest.mark.slow
ENV = "tests.sources.data_side_envs:FlatOrCoin"


def episode_run(tmp_path: Path, extra: list[str], name: str = "run") -> OnlineRL:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows()), encoding="utf-8")
    overrides = [
        "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", f"data.path={data}",
        f"env.name={ENV}", "env.max_turns=3", "max_new_tokens=5", "prompts_per_step=2", "samples_per_prompt=4",
        "eval_size=0", "steps=3", "reward_workers=0", "log_every=100", "learning_rate=1e-3",
        f"output_dir={tmp_path / name}", *extra,
    ]  # fmt: skip
    return OnlineRL(load_rl_config(None, overrides), echo=lambda line: None)


def groups(batch) -> dict[int, torch.Tensor]:
    return {int(g): batch.scores[batch.group_ids == g] for g in batch.group_ids.unique()}


def test_dynamic_sampling_trains_only_episode_groups_with_spread(tmp_path):
    plain, _ = episode_run(tmp_path, ["algorithm=grpo"], "plain").source.next_batch(1)
    assert "flat" in plain.columns["kind"]  # the step's draw holds a group without spread
    run = episode_run(tmp_path, ["algorithm=grpo", "algorithm.dynamic_sampling.enabled=true",
                                 "algorithm.dynamic_sampling.max_rounds=8"])  # fmt: skip
    for step in (1, 2):
        batch, metrics = run.source.next_batch(step)
        assert set(batch.columns["kind"]) == {"coin"} and len(groups(batch)) == 2
        assert all(scores.std() > 0 for scores in groups(batch).values())
        assert metrics["dynamic_sampling/kept_groups"] == 2 and metrics["reward/mean"] >= 0


def test_overlong_shaping_changes_the_scores_of_long_episodes(tmp_path):
    plain, _ = episode_run(tmp_path, ["algorithm=grpo"], "plain").source.next_batch(1)
    shaping = [
        "algorithm.overlong.enabled=true",
        "algorithm.overlong.max_length=8",
        "algorithm.overlong.cache_length=4",
    ]
    shaped, _ = episode_run(tmp_path, ["algorithm=grpo", *shaping]).source.next_batch(1)
    assert torch.equal(plain.response_ids, shaped.response_ids)  # the same episodes, scored apart
    lengths = plain.response_mask.sum(-1)  # the tokens the policy sampled over the episode's turns
    penalty = overlong_reward_penalty(lengths, 8, 4)
    assert torch.allclose(shaped.scores, plain.scores + penalty)
    assert (penalty < 0).any() and (lengths > 5).any()  # episodes longer than one turn's limit are shaped


def test_the_greedy_baseline_is_the_greedy_episodes_return(tmp_path):
    run = episode_run(tmp_path, ["algorithm=remax"])
    batch, metrics = run.source.next_batch(1)
    ids, first = torch.unique(batch.group_ids, return_inverse=True)
    group_rows = [{key: batch.columns[key][int(torch.nonzero(first == g)[0])] for key in ("kind", "level")}
                  for g in range(ids.numel())]  # fmt: skip
    run.evaluation.evaluate(group_rows)  # greedy episodes of the same rows, by the same policy
    returns = torch.tensor([episode["return"] for episode in run.evaluation.last_result])
    assert torch.equal(batch.baseline_scores, returns[first]) and "time/baseline_s" in metrics
    history = run.run()  # and the estimator trains on it
    assert all(torch.isfinite(torch.tensor(h["loss/policy"])) for h in history)


def test_the_difficulty_filter_drops_rows_the_policy_always_passes(tmp_path):
    run = episode_run(tmp_path, ["algorithm=grpo", "data.filter.pass_rate=[0.1, 0.9]", "data.filter.k=4"])
    rates = run.data_filter.rates
    assert rates[:12] == [1.0] * 12  # every flat episode returns 1: passed 4 of 4
    assert set(run.data_filter.kept) <= set(range(12, 24)) and run.data_filter.kept
    drawn = [kind for step in (1, 2, 3) for kind in run.source.next_batch(step)[0].columns["kind"]]
    assert set(drawn) == {"coin"}


def test_a_curriculum_over_a_column_advances_on_episode_returns(tmp_path):
    curriculum = ["data.curriculum.column=level", "data.curriculum.levels=[0, 1]", "data.curriculum.window=1",
                  "data.curriculum.advance_at=0.9"]  # fmt: skip
    run = episode_run(tmp_path, ["algorithm=grpo", *curriculum])
    first, metrics = run.source.next_batch(1)
    assert set(first.columns["kind"]) == {"flat"} and metrics["curriculum/pass_rate"] == 1.0
    second, metrics = run.source.next_batch(2)
    assert set(second.columns["kind"]) == {"coin"} and metrics["curriculum/level"] == 1.0
