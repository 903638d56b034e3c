"""``env.name`` / ``env.options`` resolution and the guarded caller's checks of what an
environment returns (the public contract, docs/design.md "Next")."""

from __future__ import annotations

import math
import textwrap

import pytest

from posttrain.envs import ENVIRONMENTS, Environment
from posttrain.envs.base import EnvSpecError, EpisodeError, GuardedEnvironment, resolve_environment


def test_builtins_are_registered_and_follow_the_contract():
    assert {"support_bot", "calculator", "python"} <= set(ENVIRONMENTS)
    for name in ("support_bot", "calculator"):
        assert isinstance(resolve_environment(name)(), Environment)


def test_unknown_name_names_the_key_and_lists_the_builtins():
    with pytest.raises(EnvSpecError) as caught:
        resolve_environment("suport_bot")
    message = str(caught.value)
    assert message.startswith("env.name:")
    assert "calculator, python, support_bot" in message and "'support_bot'?" in message
    assert "pkg.module:Class" in message


def test_bad_options_name_the_key_and_the_constructors_parameters():
    with pytest.raises(EnvSpecError) as caught:
        resolve_environment("support_bot", {"turn_costs": 0.2})
    message = str(caught.value)
    assert message.startswith("env.options")
    assert "turn_cost=0.1" in message and "wrong_fix_cost=0.5" in message and "max_turns=6" in message


def test_a_class_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent(
            """
            class GuessNumber:
                def __init__(self, secret=3):
                    self.secret = secret
                def reset(self, row):
                    return "guess"
                def step(self, completion):
                    return None, float(completion == str(self.secret)), True
            class NotAnEnv:
                def reset(self, row):
                    return "x"
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = resolve_environment("my_envs:GuessNumber", {"secret": 5})
    first, second = factory(), factory()
    assert first is not second  # one instance per episode
    assert first.step("5") == (None, 1.0, True)
    with pytest.raises(EnvSpecError, match="missing: step"):
        resolve_environment("my_envs:NotAnEnv")
    with pytest.raises(EnvSpecError, match="has no attribute 'Nope'"):
        resolve_environment("my_envs:Nope")
    with pytest.raises(EnvSpecError, match="cannot import module 'no_such_module'"):
        resolve_environment("no_such_module:Env")
    with pytest.raises(EnvSpecError, match=r"env.options .*secret=3"):
        resolve_environment("my_envs:GuessNumber", {"secrets": 5})


class Returns:
    """An environment whose step returns whatever the test says."""

    def __init__(self, value):
        self.value = value

    def reset(self, row):
        return self.value

    def step(self, completion):
        return self.value


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (("obs", 1.0), r"must return \(observation, reward, done\)"),
        (("obs", math.nan, False), "finite number"),
        (("obs", True, False), "finite number"),
        (("obs", 1.0, "yes"), "done must be True or False"),
        ((42, 1.0, False), "an observation is a string"),
        (([{"role": "user"}], 1.0, False), "an observation is a string"),
        ((None, 1.0, False), "no observation but done=False"),
    ],
)
def test_malformed_step_results_are_episode_errors(value, fragment):
    guarded = GuardedEnvironment(Returns(value), timeout_s=5)
    guarded.turn = 2  # the third step of an episode
    with pytest.raises(EpisodeError, match=fragment) as caught:
        guarded.step("x")
    assert caught.value.kind == "invalid" and caught.value.turn == 3


def test_well_formed_results_pass_through():
    guarded = GuardedEnvironment(Returns(([{"role": "tool", "content": "42"}], 1, False)), timeout_s=5)
    result = guarded.step("x")
    assert result.observation == [{"role": "tool", "content": "42"}]
    assert result.reward == 1.0 and isinstance(result.reward, float) and result.done is False
    assert GuardedEnvironment(Returns((None, None, True))).step("x").reward is None
    with pytest.raises(EpisodeError, match="reset of turn 0"):
        GuardedEnvironment(Returns(None)).reset({})
