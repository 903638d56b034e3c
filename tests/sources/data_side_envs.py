"""An environment for the data-side feature tests: a row of kind "flat" returns 1 whatever the bot
says (its episodes never differ: a group without spread, a prompt always passed); a row of kind
"coin" asks twice and returns the parity of the second answer's length (its episodes differ).
Only the environment contract, no posttrain import (``env.name: tests.sources.data_side_envs:FlatOrCoin``)."""

from __future__ import annotations


class FlatOrCoin:
    def reset(self, row):
        self.kind, self.turn = row["kind"], 0
        return f"{self.kind}:"

    def step(self, completion):
        self.turn += 1
        if self.kind == "flat":
            return None, 1.0, True
        if self.turn < 2:
            return " again:", 0.0, False
        return None, float(len(completion) % 2), True


def rows(n_flat: int = 12, n_coin: int = 12) -> list[dict]:
    """Flat rows at level 0, coin rows at level 1 (a curriculum's column)."""
    return [{"kind": "flat", "level": 0}] * n_flat + [{"kind": "coin", "level": 1}] * n_coin
