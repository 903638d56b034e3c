"""The ``support_bot`` environment: a rule-based simulated user with a hidden problem (seed
001's service-bot MDP: the user responds; the reward is whether the user marks the issue
resolved).

The user opens with a symptom that two issues share; the bot may ask about a clue
(``ask: battery?``) and the user answers truthfully ("yes" only for the clue of the hidden
issue); the bot proposes a fix (``fix: charge``). The right fix resolves the issue (reward 1,
done); a wrong one costs ``wrong_fix_cost`` and the user says it did not help. Every turn
costs ``turn_cost``; after ``max_turns`` bot turns the user gives up (done, no resolution —
an ending of the environment itself, unlike ``env.max_turns``, which truncates any
environment from outside).

Made to be learnable by a tiny character-level model: the bot's whole action language is the
two regular forms above, stated with the valid words in the first message. A cold start on
:func:`scripted_actions` (a bot that searches the clues in a random order until a "yes.")
teaches the language and that a "yes." names the fix; RL can then learn which clues fit the
symptom. The best policy asks one of the symptom's two candidate clues and then fixes: the
clue's fix after "yes.", the other candidate's after "no." — always resolved, in two turns,
return 1 - 2c. Guessing a fix without asking pays 1 - c half of the time and 1 - 2c - w the
other half (worse with the defaults c = 0.1, w = 0.5), and every needless question costs c.
"""

from __future__ import annotations

import random
import re
from typing import Any

from posttrain.data.tasks.support import CLUES, FIXES, ISSUES, ISSUES_BY_NAME, Issue, support_rows
from posttrain.envs.base import register_environment

__all__ = ["CLUES", "FIXES", "ISSUES", "Issue", "SupportBot", "scripted_actions", "support_rows"]


_ASK = re.compile(r"ask:\s*([a-z]+)\s*\?")
_FIX = re.compile(r"fix:\s*([a-z]+)")

RESOLVED = "thanks, it works now!"
NOT_FIXED = "that did not help."
NOT_UNDERSTOOD = "sorry? write ask: <word>? or fix: <word>"


def opening(issue: Issue) -> str:
    """The user's first message: the rules of the bot's language, then the symptom."""
    return f"ask about: {' '.join(CLUES)}. fixes: {' '.join(FIXES)}.\n{issue.symptom}"


def hidden_issue(row: dict[str, Any]) -> Issue:
    """The row's hidden issue: its ``issue`` column (a name of :data:`ISSUES`), else drawn from
    its ``seed`` column."""
    if "issue" in row:
        if row["issue"] not in ISSUES_BY_NAME:
            raise KeyError(f"support_bot: unknown issue {row['issue']!r}; valid: {', '.join(ISSUES_BY_NAME)}")
        return ISSUES_BY_NAME[row["issue"]]
    if "seed" in row:
        return random.Random(int(row["seed"])).choice(ISSUES)
    raise KeyError(f"support_bot needs an 'issue' or a 'seed' column; the row has {sorted(row)}")


@register_environment("support_bot")
class SupportBot:
    """The simulated user (module docstring). Options: ``turn_cost`` (c, taken from every
    turn's reward), ``wrong_fix_cost`` (w, taken from a turn proposing a wrong fix),
    ``max_turns`` (bot turns before the user gives up; a row's ``difficulty`` d takes d off, down
    to 2: ``data/tasks/support.py``) and ``give_up_cost`` (taken from the turn where the user
    gives up unresolved)."""

    def __init__(
        self, turn_cost: float = 0.1, wrong_fix_cost: float = 0.5, max_turns: int = 6, give_up_cost: float = 1.0
    ) -> None:
        if turn_cost < 0 or wrong_fix_cost < 0 or give_up_cost < 0 or max_turns < 1:
            raise ValueError(
                f"support_bot: turn_cost, wrong_fix_cost and give_up_cost must be >= 0 and max_turns >= 1, got "
                f"{turn_cost}, {wrong_fix_cost}, {give_up_cost}, {max_turns}"
            )
        self.turn_cost, self.wrong_fix_cost, self.max_turns = turn_cost, wrong_fix_cost, max_turns
        self.give_up_cost = give_up_cost
        self.issue: Issue | None = None
        self.patience = max_turns  # bot turns before this user gives up (the row's difficulty takes some off)
        self.turns = 0
        self.resolved = False  # read by the rollout source for env/resolved

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.issue, self.turns, self.resolved = hidden_issue(row), 0, False
        # a question and a fix at least (or every turn the options allow)
        self.patience = max(min(2, self.max_turns), self.max_turns - int(row.get("difficulty", 0)))
        return [{"role": "user", "content": opening(self.issue)}]

    def step(self, completion: str) -> tuple[list[dict[str, str]] | None, float, bool]:
        if self.issue is None:
            raise RuntimeError("support_bot: step before reset")
        self.turns += 1
        reply, reward, done = self.respond(completion.strip().lower())
        self.resolved = done
        reward -= self.turn_cost
        if not done and self.turns >= self.patience:
            # the user gives up, unhappy: without this cost a bot that never commits to a fix
            # (questions, gibberish) ends at -max_turns·c, better than trying a wrong fix, and
            # RL learns exactly that (the first run of examples/support_bot.py did)
            return None, reward - self.give_up_cost, True
        return (None if done else [{"role": "user", "content": reply}]), reward, done

    def respond(self, action: str) -> tuple[str, float, bool]:
        """(the user's reply, reward before the turn cost, resolved) for one bot action."""
        assert self.issue is not None
        fix = _FIX.fullmatch(action)
        if fix:
            if fix.group(1) == self.issue.fix:
                return RESOLVED, 1.0, True
            return NOT_FIXED, -self.wrong_fix_cost, False
        ask = _ASK.fullmatch(action)
        if ask:
            clue = ask.group(1)
            if clue not in CLUES:
                return f"i do not know about {clue}.", 0.0, False
            return ("yes." if clue == self.issue.clue else "no."), 0.0, False
        return NOT_UNDERSTOOD, 0.0, False


# ------------------------------------------------------------------------------------- data


def scripted_actions(n: int, seed: int = 0, max_turns: int = 4) -> list[tuple[dict[str, str], list[str]]]:
    """``n`` scripted dialogues as (row, the bot's actions) of a *searching* bot: it asks about
    the clues in a random order, whatever the symptom, until the user says "yes.", then gives
    that clue's fix; cut to ``max_turns`` actions (when the clue comes too late the user gives
    up). A cold start on these teaches the action language and that a "yes." names the fix, but
    not which clues fit the symptom: that is left to RL, which can resolve more issues (ask one
    of the symptom's two candidate clues first) in fewer turns."""
    if max_turns < 2:
        raise ValueError(f"max_turns must be >= 2 (a question and a fix), got {max_turns}")
    rng = random.Random(seed)
    dialogues = []
    for _ in range(n):
        issue = rng.choice(ISSUES)
        order = rng.sample(CLUES, len(CLUES))
        found = order.index(issue.clue)
        actions = [f"ask: {clue}?" for clue in order[: found + 1]] + [f"fix: {issue.fix}"]
        dialogues.append(({"issue": issue.name}, actions[:max_turns]))
    return dialogues


def scripted_conversations(n: int, seed: int = 0, max_turns: int = 4) -> list[dict[str, Any]]:
    """Cold-start SFT rows in the ``messages`` format (``SFTObjective.encode``) from
    :func:`scripted_actions`: one row per bot turn, each a prefix of its conversation ending in
    that turn. SFT on ``messages`` trains every assistant turn of a row (``conversation_example``),
    so a turn is trained once per prefix that holds it (early turns weigh more; the last prefix of
    each conversation alone weighs each turn once); ``envs/episode.py:replay_actions`` builds the
    same tokens from the actions directly."""
    rows = []
    for row, actions in scripted_actions(n, seed, max_turns):
        rows.extend(_prefix_rows(ISSUES_BY_NAME[row["issue"]], actions))
    return rows


def _prefix_rows(issue: Issue, actions: list[str]) -> list[dict[str, Any]]:
    user = SupportBot(max_turns=len(actions) + 1)
    messages = user.reset({"issue": issue.name})
    rows = []
    for action in actions:
        messages = [*messages, {"role": "assistant", "content": action}]
        rows.append({"messages": messages})
        reply, _, _ = user.step(action)
        if reply is not None:
            messages = [*messages, *reply]
    return rows
