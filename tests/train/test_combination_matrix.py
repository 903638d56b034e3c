"""The combination matrix (issue 42): every pair of RL features runs two steps and each feature
takes effect (``matrix_features.py`` says what that means for each), or the pair is refused before
anything loads — and only the pairs that cannot mean anything are refused, each message saying why.
A replayed pair replays a recording of the same pair: the replay repeats its losses."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from posttrain.config import ConfigError
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

from .matrix_features import FEATURES, Trace, base_overrides, write_rows

pytestmark = pytest.mark.slow

# the only pairs refused: replay samples nothing, so nothing overlaps sampling with training
REFUSED = {
    frozenset({"replay", "max_staleness"}): "rollout.replay samples nothing",
    frozenset({"replay", "interrupt"}): "rollout.replay samples nothing",
}
PAIRS = list(itertools.combinations(FEATURES, 2))


def traced(overrides: list[str]) -> Trace:
    """Run ``overrides`` in this process, keeping every batch the update trained on."""
    config = load_rl_config(None, overrides)
    run = OnlineRL(config, echo=lambda line: None)
    batches, prepare = [], run.prepare

    def keep(batch, metrics):
        batches.append(batch)
        return prepare(batch, metrics)

    run.prepare = keep
    policy = {name: p.detach().clone() for name, p in run.policy.named_parameters()}
    critic = {} if run.critic is None else {n: p.detach().clone() for n, p in run.critic.named_parameters()}
    history = run.run()
    return Trace(run, history, batches, Path(config.output_dir), policy, critic)


def losses(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith(("loss/", "policy/grad_norm"))} for h in history]


@pytest.mark.parametrize("pair", PAIRS, ids=["×".join(pair) for pair in PAIRS])
def test_every_pair_runs_and_each_feature_takes_effect(tmp_path, pair):
    data = write_rows(tmp_path / "rows.jsonl")
    features = [FEATURES[name] for name in pair]
    extra = [override for feature in features for override in feature.overrides]
    if frozenset(pair) in REFUSED:
        replay = [f"rollout.replay={tmp_path}"]
        with pytest.raises(ConfigError, match=REFUSED[frozenset(pair)]):
            load_rl_config(None, [*base_overrides(data, tmp_path / "run"), *extra, *replay])
        return
    if "replay" in pair:  # record the pair, then replay the recording with it
        recorded = traced([*base_overrides(data, tmp_path / "recorded"), *extra, "record_rollouts=true"])
        for feature in features:
            feature.check(recorded)
        replay = [f"rollout.replay={tmp_path / 'recorded' / 'rollouts'}"]
        replayed = traced([*base_overrides(data, tmp_path / "run"), *extra, *replay])
        assert losses(replayed.history) == losses(recorded.history)
        return
    trace = traced([*base_overrides(data, tmp_path / "run"), *extra])
    assert len(trace.history) == 2
    for feature in features:
        feature.check(trace)
