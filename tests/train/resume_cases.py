"""Shared by the resume tests: rows whose reward is 0 for every sample of some steps (so those
steps train no sample), a reward that reads them, and a config that runs them.

Which steps are "dead" is decided through the run's own sampler: the rows it draws at a dead
step get ``live = 0``. The reward is a top-level function, so the CLI can name it by path."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.data.sampler import EpochSampler

ROWS = 64
PROMPTS_PER_STEP = 4
SEED = 0


def vowel_share_if_live(prompts, completions, completion_ids, live, **columns):
    """Share of vowels where the row is live, else 0: a dead step's groups all score 0."""
    return [
        (sum(c in "aeiou" for c in text) / max(len(text), 1)) if flag else 0.0
        for text, flag in zip(completions, live, strict=True)
    ]


def rows_with_dead_steps(dead_steps: set[int], steps: int) -> list[dict]:
    """Reversal prompts; the rows drawn at ``dead_steps`` (1-based) have live = 0."""
    sampler = EpochSampler(ROWS, PROMPTS_PER_STEP, SEED)
    live = [1] * ROWS
    for step in range(1, steps + 1):
        batch = sampler.next_batch()
        if step in dead_steps:
            for index in batch:
                live[index] = 0
    names = [f"{a}{b}{c}" for a in "bcdfg" for b in "aeiou" for c in "lmnrst"][:ROWS]
    return [{"prompt": f"Reverse the name {name}:", "live": flag} for name, flag in zip(names, live, strict=True)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def overrides(data_file: Path, output_dir: Path, steps: int, extra: list[str] = ()) -> list[str]:
    return [
        "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2",
        f"data.path={data_file}", "eval_size=0", f"prompts_per_step={PROMPTS_PER_STEP}", f"seed={SEED}",
        "samples_per_prompt=4", "max_new_tokens=6", "learning_rate=1e-2", "log_every=100", "reward_workers=0",
        "rewards=[tests.train.resume_cases:vowel_share_if_live]", f"steps={steps}", "save_every=1",
        f"output_dir={output_dir}", *extra,
    ]  # fmt: skip


class RunningNormalizedVowels:
    """``vowel_share_if_live`` normalised by the running mean of everything scored so far: its
    scores depend on every earlier batch, as a model reward's ``normalize: running`` does."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def __call__(self, prompts, completions, completion_ids, live, **columns):
        raw = vowel_share_if_live(prompts, completions, completion_ids, live)
        self.total, self.count = self.total + sum(raw), self.count + len(raw)
        mean = self.total / self.count
        return [value - mean for value in raw]

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count = float(state["total"]), int(state["count"])


running_vowels = RunningNormalizedVowels()
