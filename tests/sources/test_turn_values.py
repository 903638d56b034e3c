"""A reward function may score an episode turn by turn: one value per assistant turn, each (times
the function's weight) placed on its turn's last sampled token as an environment's turn rewards
are, so the token rewards still sum to the episode's score. A list of another length, or a list
for a single completion, stops the run naming the function."""

from __future__ import annotations

import pytest
import torch

from posttrain.envs.section import EnvSection
from posttrain.rewards import RewardFunctionError, RewardSet
from posttrain.rewards.registry import resolve_rewards
from posttrain.rollout.engine import build_engine
from posttrain.sources.environment import EnvironmentSource
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_sources import sampling_plan
from tests.sources.test_environment import BASE, policy  # noqa: F401  (the fixture)


def per_turn(prompts, completions, **columns):
    """Turn k of an episode earns k / 10."""
    return [[0.1 * k for k in range(1, 1 + sum(m["role"] == "assistant" for m in c))] for c in completions]


def one_too_many(prompts, completions, **columns):
    return [[0.0] * (2 + sum(m["role"] == "assistant" for m in c)) for c in completions]


def source_with(policy, function, weight):  # noqa: F811
    model, tokenizer = policy
    config = load_rl_config(None, [*BASE, "max_new_tokens=12", "sampling.stop=[a,e,i,o,u,A,E]"])
    rewards = RewardSet(resolve_rewards([function], [weight]), workers=0)
    section = EnvSection(name="tests.sources.test_environment:Echo")
    rows = [{"id": i} for i in range(3)]
    return EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, rows, rewards,
        context_limit=512, echo=lambda s: None,
    )  # fmt: skip


def test_per_turn_values_sit_on_their_turns_beside_the_environments_own(policy):  # noqa: F811
    batch, _ = source_with(policy, per_turn, weight=2.0).next_batch(1)
    for i in range(len(batch)):
        mask = batch.response_mask[i]
        ends = [t for t in range(len(mask)) if mask[t] == 1 and (t + 1 == len(mask) or mask[t + 1] == 0)]
        # Echo's 0.25 a turn, plus the function's k / 10 times its weight 2
        expected = [0.25 + 2.0 * 0.1 * k for k in range(1, len(ends) + 1)]
        assert torch.nonzero(batch.turn_rewards[i]).flatten().tolist() == ends
        assert batch.turn_rewards[i][ends].tolist() == pytest.approx(expected)
        assert batch.scores[i].item() == pytest.approx(sum(expected))  # the token rewards sum to the score
        assert batch.reward_components[i, 0].item() == pytest.approx(sum(0.1 * k for k in range(1, len(ends) + 1)))


def test_a_list_of_another_length_than_the_turns_is_refused_naming_the_function(policy):  # noqa: F811
    with pytest.raises(RewardFunctionError, match="'one_too_many' returned 5 per-turn values for an episode of 3"):
        source_with(policy, one_too_many, weight=1.0).next_batch(1)


def test_a_single_completion_takes_one_value_not_a_list():
    rewards = RewardSet(
        resolve_rewards([lambda prompts, completions, **kw: [[1.0, 0.0]] * len(completions)]), workers=0
    )
    with pytest.raises(RewardFunctionError, match="one value per assistant turn is for episodes"):
        rewards.score(["p"], ["c"], [[1]])


def with_a_hole(prompts, completions, **columns):
    return [[None, *[0.1] * sum(m["role"] == "assistant" for m in c)][:-1] for c in completions]


def as_text(prompts, completions, **columns):
    return [["0.5"] * sum(m["role"] == "assistant" for m in c) for c in completions]


def test_none_or_text_inside_a_per_turn_list_says_what_to_return(policy):  # noqa: F811
    """Hardening 3, items 16 and 18: text was trained as numbers; None was refused with a message
    asking for 'a float or None'."""
    with pytest.raises(RewardFunctionError, match="return None instead of the list to leave the episode unscored"):
        source_with(policy, with_a_hole, weight=1.0).next_batch(1)
    with pytest.raises(RewardFunctionError, match=r"'as_text' returned '0\.5' for completion 0"):
        source_with(policy, as_text, weight=1.0).next_batch(1)
