"""The ``support_bot`` task: the hidden issues of the simulated user (``envs/support_bot.py``) and
the rows that draw them, one issue and a difficulty per row.

A row's ``difficulty`` is how impatient its user is: with difficulty d the user gives up after
``max_turns − d`` bot turns (at least 2: one question and a fix), so on difficulty 0 a bot may
search the clues for a while, and on the hardest it must ask a clue that fits the symptom
first. A curriculum over the column (``data.curriculum: {column: difficulty, levels: [0, 1, 2]}``)
trains on patient users first."""

from __future__ import annotations

import random
from dataclasses import dataclass

DIFFICULTIES = (0, 1, 2)  # bot turns taken off the user's patience
DIFFICULTY_STREAM = 0x5EED  # difficulties are drawn apart from the issues: a row's issue does not depend on them


@dataclass(frozen=True)
class Issue:
    """A hidden problem: the symptom the user reports, the clue that is true only for it
    (what ``ask: <clue>?`` confirms) and the fix that resolves it."""

    name: str
    symptom: str
    clue: str
    fix: str


# Three symptoms, each shared by two issues, told apart by either issue's clue.
ISSUES = (
    Issue("flat_battery", "my laptop will not turn on", "battery", "charge"),
    Issue("loose_cord", "my laptop will not turn on", "cord", "plug"),
    Issue("router_down", "my wifi does not work", "router", "reboot"),
    Issue("wrong_password", "my wifi does not work", "password", "reset"),
    Issue("dim_screen", "my screen is dark", "brightness", "brighten"),
    Issue("old_driver", "my screen is dark", "driver", "update"),
)
ISSUES_BY_NAME = {issue.name: issue for issue in ISSUES}
CLUES = tuple(issue.clue for issue in ISSUES)
FIXES = tuple(issue.fix for issue in ISSUES)


def support_rows(n: int, seed: int = 0) -> list[dict[str, str | int]]:
    """``n`` dataset rows ``{"issue": name, "difficulty": d}``, hidden issues and difficulties
    each drawn uniformly with ``seed``."""
    rng, hardness = random.Random(seed), random.Random(seed + DIFFICULTY_STREAM)
    issues = [rng.choice(ISSUES).name for _ in range(n)]
    return [{"issue": issue, "difficulty": hardness.choice(DIFFICULTIES)} for issue in issues]
