"""The built-in environments driven by scripted policies (issue 19, item 3), and environments
that raise or hang ending their episode as a counted error through the guarded caller."""

from __future__ import annotations

import asyncio
import builtins
import shutil
import time

import pytest

from posttrain.envs.base import EpisodeError, GuardedEnvironment, resolve_environment
from posttrain.envs.calculator import Calculator, evaluate
from posttrain.envs.episode import Episode, EpisodeLimits
from posttrain.envs.support_bot import (
    CLUES,
    FIXES,
    ISSUES,
    NOT_FIXED,
    SupportBot,
    hidden_issue,
    scripted_conversations,
    support_rows,
)
from posttrain.envs.tools import ToolCallError, answers_match
from posttrain.models.chat import DEFAULT_CHAT_TEMPLATE, split_conversation
from posttrain.models.tokenizers import build_char_tokenizer

# ------------------------------------------------------------------------------ support_bot


def user_text(observation) -> str:
    assert isinstance(observation, list) and observation[0]["role"] == "user"
    return observation[0]["content"]


def test_first_message_states_the_action_language_and_an_ambiguous_symptom():
    for issue in ISSUES:
        text = user_text(SupportBot().reset({"issue": issue.name}))
        assert "ask about:" in text and "fixes:" in text
        assert all(clue in text for clue in CLUES) and all(fix in text for fix in FIXES)
        assert text.endswith(issue.symptom)
        # the symptom alone does not tell the issue: exactly two share it
        assert sum(other.symptom == issue.symptom for other in ISSUES) == 2


def test_questions_are_answered_truthfully():
    for issue in ISSUES:
        bot = SupportBot(max_turns=len(CLUES) + 1)
        bot.reset({"issue": issue.name})
        for clue in CLUES:
            observation, reward, done = bot.step(f"ask: {clue}?")
            assert user_text(observation) == ("yes." if clue == issue.clue else "no.")
            assert reward == pytest.approx(-0.1) and not done


def test_right_fix_after_a_question_resolves_with_reward_one():
    bot = SupportBot()
    bot.reset({"issue": "router_down"})
    assert user_text(bot.step("ask: router?")[0]) == "yes."
    observation, reward, done = bot.step("fix: reboot")
    assert observation is None and done
    assert reward == pytest.approx(1.0 - 0.1)


def test_wrong_fix_does_not_resolve_and_costs():
    bot = SupportBot(turn_cost=0.1, wrong_fix_cost=0.5)
    bot.reset({"issue": "router_down"})
    observation, reward, done = bot.step("fix: reset")
    assert user_text(observation) == NOT_FIXED and not done
    assert reward == pytest.approx(-0.6)
    _, reward, done = bot.step("fix: reboot")  # the right one still works afterwards
    assert done and reward == pytest.approx(0.9)


def test_turn_cost_is_an_option_and_the_user_gives_up_after_max_turns():
    bot = resolve_environment("support_bot", {"turn_cost": 0.25, "max_turns": 3, "give_up_cost": 2.0})()
    bot.reset({"issue": "dim_screen"})
    results = [bot.step("ask: driver?"), bot.step("hello"), bot.step("ask: cord?")]
    # giving up costs more than trying a wrong fix: a bot that never commits must not come out ahead
    assert [reward for _, reward, _ in results] == [-0.25, -0.25, -0.25 - 2.0]
    assert user_text(results[1][0]).startswith("sorry?")  # not an action: the format is repeated
    assert [done for _, _, done in results] == [False, False, True]
    assert results[2][0] is None  # gave up: no more messages


def test_hidden_issue_comes_from_the_row_or_its_seed():
    assert hidden_issue({"issue": "old_driver"}).fix == "update"
    drawn = [hidden_issue({"seed": seed}).name for seed in range(40)]
    assert drawn == [hidden_issue({"seed": seed}).name for seed in range(40)]  # deterministic
    assert len(set(drawn)) == len(ISSUES)
    assert support_rows(20, seed=1) == support_rows(20, seed=1) != support_rows(20, seed=2)
    with pytest.raises(KeyError, match="valid"):
        hidden_issue({"issue": "gremlins"})


def test_scripted_conversations_teach_the_format_and_search_until_a_yes():
    rows = scripted_conversations(60, seed=0, max_turns=4)
    tokenizer = build_char_tokenizer()
    ends = {"resolved": 0, "gave up": 0}
    for row in rows:
        history, answer = split_conversation(row["messages"])  # what SFT trains on
        assert history[0]["role"] == "user"
        assert answer.startswith(("ask: ", "fix: "))
        text = "".join(m["content"] for m in row["messages"])
        assert tokenizer.unk_token_id not in tokenizer(text, add_special_tokens=False)["input_ids"]
        actions = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        # replay the conversation against the simulated user: its answers are the script's
        issue = _issue_of(row)
        bot = SupportBot(max_turns=4)
        assert user_text(bot.reset({"issue": issue})) == history[0]["content"]
        results = [bot.step(action) for action in actions]
        replies = [m["content"] for m in row["messages"][1:] if m["role"] == "user"]
        # (the row ends with the bot's turn it trains: no answer to it yet)
        assert replies == [user_text(observation) for observation, _, _ in results[:-1]]
        asked = [a.removeprefix("ask: ").removesuffix("?") for a in actions if a.startswith("ask: ")]
        assert len(set(asked)) == len(asked)  # never the same clue twice
        if answer.startswith("fix: "):  # a whole conversation: a "yes." names the fix
            assert replies[-1] == "yes." and set(replies[:-1]) <= {"no."}
            assert results[-1][2] and bot.resolved
            ends["resolved"] += 1
        elif len(actions) == 4:  # the clue came too late: four questions, the user gives up
            assert results[-1][2] and not bot.resolved
            ends["gave up"] += 1
    # six clues in a random order: the hidden one is among the first three asked half the time
    assert 0.3 < ends["resolved"] / (ends["resolved"] + ends["gave up"]) < 0.7


def _issue_of(row) -> str:
    """The hidden issue of a scripted conversation: the one whose clue the user said "yes." to,
    else one with the reported symptom whose clue was not asked (its answers are the same)."""
    messages = row["messages"]
    for asked, reply in zip(messages[1::2], messages[2::2], strict=False):
        if reply["content"] == "yes.":
            return next(issue.name for issue in ISSUES if f"ask: {issue.clue}?" == asked["content"])
    asked = {m["content"] for m in messages[:-1] if m["role"] == "assistant"}  # each answered "no."
    symptom = messages[0]["content"].split("\n")[-1]
    return next(i.name for i in ISSUES if i.symptom == symptom and f"ask: {i.clue}?" not in asked)


def test_support_bot_episode_with_a_char_tokenizer():
    # the tiny character-level setting: scripted policy tokens through the episode assembly
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    env = GuardedEnvironment(SupportBot(), timeout_s=5)
    episode = Episode.start(tokenizer, env.reset({"issue": "wrong_password"}), EpisodeLimits(max_new_tokens=24))
    for action in ["ask: router?", "ask: password?", "fix: reset"]:
        ids = [*tokenizer(action, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        result = env.step(episode.add_turn(ids))
        episode.add_result(result.observation, result.reward, result.done)
    assert episode.stop_reason == "done" and episode.texts == ["ask: router?", "ask: password?", "fix: reset"]
    assert [round(r, 6) for _, r in episode.rewards] == [-0.1, -0.1, 0.9]
    assert "no." in tokenizer.decode(episode.ids) and "yes." in tokenizer.decode(episode.ids)
    assert sum(episode.mask) == sum(len(text) + 1 for text in episode.texts)


# ------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2*(3+4)", 14),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-7//2", -4),
        ("10%4", 2),
        ("-3**2", -9),
        ("(1+2)*-3", -9),
        ("2**10", 1024),
        ("2.5*4", 10.0),
        ("+5 - -5", 10),
    ],
)
def test_calculator_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "Call"),
        ("open('/etc/passwd')", "Call"),
        ("x + 1", "Name"),
        ("(1).__class__", "Attribute"),
        ("'a' * 3", "Constant"),
        ("True + 1", "Constant"),
        ("[1, 2][0]", "Subscript"),
        ("1 < 2", "Compare"),
        ("1 & 3", "BitAnd"),
        ("lambda: 1", "Lambda"),
        ("9**9**9", "too large"),
        ("10**400", "too large"),
        ("1e400", "too large"),
        ("(10**30) * 10", "too large"),
        ("1/0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**0.5", "not a real number"),
        ("2 +", "cannot parse"),
        ("1+" * 150 + "1", "longer than"),
    ],
)
def test_calculator_refuses_unsafe_or_invalid_input(expression, reason):
    start = time.perf_counter()
    with pytest.raises(ToolCallError, match=reason):
        evaluate(expression)
    assert time.perf_counter() - start < 0.5  # refused before computing, never a stall


def test_calculator_never_evaluates_with_eval(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert evaluate("2*(3+4)") == 14


def test_calculator_episode_tool_call_then_answer():
    env = resolve_environment("calculator", {})()
    first = env.reset({"question": "What is 2*(3+4)?", "answer": "14"})
    assert "<calc>" in first[0]["content"] and "What is 2*(3+4)?" in first[0]["content"]
    assert env.step("let me compute <calc>2*(3+4)</calc>") == (
        [{"role": "tool", "content": "<result>14</result>"}],
        None,
        False,
    )
    assert env.step("<answer>14</answer>") == (None, 1.0, True)
    env.reset({"question": "What is 2*(3+4)?", "answer": "14"})
    assert env.step("<answer>15</answer>") == (None, 0.0, True)


def test_calculator_malformed_calls_get_an_error_observation():
    env = Calculator(chat=False)
    assert env.reset({"question": "q", "answer": 1}).endswith("Question: q\n")
    observation, reward, done = env.step("<calc>import os</calc>")
    assert observation.strip().startswith("<error>cannot parse") and reward is None and not done
    observation, _, _ = env.step("<calc>__import__('os')</calc>")
    assert "not allowed" in observation
    observation, _, done = env.step("I think it is one")
    assert "no <calc>" in observation and not done


def test_answers_compare_as_numbers_or_text():
    assert answers_match("14.0", 14) and answers_match(" 1,400 ", "1400") and answers_match("Paris", "paris")
    assert not answers_match("14.5", 14) and not answers_match("rome", "paris")


# ----------------------------------------------------------------------------------- python

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
FAST = {"wall_s": 3.0, "cpu_s": 1.0, "memory_mb": 512}


@needs_bwrap
def test_python_tool_output_and_answer():
    env = resolve_environment("python", {"limits": FAST, "max_output_chars": 60})()
    env.reset({"question": "What is 6 times 7?", "answer": 42})
    assert env.step("<python>print(6 * 7)</python>") == (
        [{"role": "tool", "content": "<output>42</output>"}],
        None,
        False,
    )
    raised = env.step("<python>print('before')\n1 / 0</python>")[0][0]["content"]
    assert raised == "<output>before\nZeroDivisionError: division by zero</output>"
    long = env.step("<python>print('x' * 1000)</python>")[0][0]["content"]
    assert long == "<output>" + "x" * 60 + "...[940 more characters]</output>"
    hung = env.step("<python>while True: pass</python>")[0][0]["content"]
    assert "[stopped:" in hung
    assert env.step("<answer>42</answer>") == (None, 1.0, True)


@needs_bwrap
def test_python_tool_program_cannot_read_the_trainers_environment(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_ENV_SECRET", "hunter2")
    env = resolve_environment("python", {"limits": FAST})()
    env.reset({"question": "q", "answer": 0})
    observation = env.step("<python>import os; print(os.environ.get('POSTTRAIN_ENV_SECRET'))</python>")[0]
    assert observation[0]["content"] == "<output>None</output>"


@needs_bwrap
def test_python_sandbox_failure_is_an_episode_error_not_a_lost_turn():
    from posttrain.rewards.sandbox import Limits, Sandbox

    env = resolve_environment("python", {"limits": FAST})()
    env.sandbox = Sandbox(Limits(**FAST), bwrap="/nonexistent/bwrap")  # the jail breaks after start-up
    guarded = GuardedEnvironment(env, timeout_s=10, name="python")
    guarded.reset({"question": "q", "answer": 0})
    with pytest.raises(EpisodeError) as caught:
        guarded.step("<python>print(1)</python>")
    assert caught.value.kind == "raised" and caught.value.turn == 1
    assert "could not run the program" in str(caught.value)


# ------------------------------------------------------------- raising and hanging environments


class Raising:
    def reset(self, row):
        return "start"

    def step(self, completion):
        raise ValueError(f"cannot handle {completion!r}")


class Hanging:
    def reset(self, row):
        return "start"

    def step(self, completion):
        time.sleep(30)  # a daemon thread: abandoned at the timeout, never joined
        return "late", 1.0, False


class AsyncHanging:
    async def reset(self, row):
        return [{"role": "user", "content": "start"}]

    async def step(self, completion):
        await asyncio.sleep(30)
        return None, 1.0, True


def test_a_raising_environment_ends_the_episode_as_an_error_with_turn_and_cause():
    guarded = GuardedEnvironment(Raising(), timeout_s=5, name="raising")
    assert guarded.reset({}) == "start"
    with pytest.raises(EpisodeError) as caught:
        guarded.step("ask: router?")
    error = caught.value
    assert error.turn == 1 and error.kind == "raised" and isinstance(error.cause, ValueError)
    assert "'raising'" in str(error) and "turn 1" in str(error) and "ValueError" in str(error)


def test_a_hanging_environment_times_out_as_an_episode_error():
    guarded = GuardedEnvironment(Hanging(), timeout_s=0.3)
    guarded.reset({})
    start = time.perf_counter()
    with pytest.raises(EpisodeError) as caught:
        guarded.step("hello")
    assert time.perf_counter() - start < 3
    assert caught.value.kind == "timeout" and caught.value.turn == 1 and "0.3 s" in str(caught.value)


def test_async_environments_are_awaited_and_time_out_too():
    async def run():
        guarded = GuardedEnvironment(AsyncHanging(), timeout_s=0.3)
        first = await guarded.areset({})
        with pytest.raises(EpisodeError) as caught:
            await guarded.astep("hello")
        return first, caught.value

    first, error = asyncio.run(run())
    assert first == [{"role": "user", "content": "start"}]
    assert error.kind == "timeout" and error.turn == 1
    # the sync caller awaits coroutines as well (on its own loop in the worker thread)
    guarded = GuardedEnvironment(AsyncHanging(), timeout_s=0.3)
    assert guarded.reset({}) == [{"role": "user", "content": "start"}]
    with pytest.raises(EpisodeError, match="did not return"):
        guarded.step("hello")


def test_a_raising_sync_environment_through_the_async_caller():
    async def run():
        guarded = GuardedEnvironment(Raising(), timeout_s=5)
        await guarded.areset({})
        await guarded.astep("first")

    with pytest.raises(EpisodeError) as caught:
        asyncio.run(run())
    assert caught.value.kind == "raised" and caught.value.turn == 1


class OwnTimeout:
    """Raises TimeoutError itself (a request it made timed out): an error, not our timeout."""

    def reset(self, row):
        return "start"

    async def step(self, completion):
        raise TimeoutError("upstream service timed out")


def test_an_environments_own_timeout_error_is_reported_as_raised():
    guarded = GuardedEnvironment(OwnTimeout(), timeout_s=5)
    with pytest.raises(EpisodeError) as caught:
        guarded.step("x")
    assert caught.value.kind == "raised" and "upstream service" in str(caught.value)

    async def run():
        await guarded.areset({})
        await guarded.astep("x")

    with pytest.raises(EpisodeError) as caught:
        asyncio.run(run())
    assert caught.value.kind == "raised" and isinstance(caught.value.cause, TimeoutError)


class NumpyScored:
    def reset(self, row):
        return "start"

    def step(self, completion):
        import numpy as np

        return None, np.float32(0.75), np.bool_(True).item()


def test_a_numpy_reward_is_a_number():
    """Issue 45, item 5: an environment scoring with NumPy (np.float32) was refused."""
    guarded = GuardedEnvironment(NumpyScored(), timeout_s=5)
    guarded.reset({})
    result = guarded.step("x")
    assert result.reward == 0.75 and type(result.reward) is float
