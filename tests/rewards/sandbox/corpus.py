"""Shared pieces of the hostile corpus: how a program is written down and what it may get."""

from __future__ import annotations

from textwrap import dedent

ANY = None  # every verdict but pass and infra_error
TIMEOUT = {"timeout"}
MEMORY = {"memory"}
CRASH = {"crash"}


def program(source: str, verdicts: set[str] | None = ANY, helper: str = "") -> tuple[str, set[str] | None]:
    return dedent(helper) + dedent(source).strip() + "\n", verdicts
