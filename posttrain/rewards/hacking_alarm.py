"""The reward-hacking alarm: the optimised reward rising while a monitor of what it stands for falls.

A *monitor* is a reward the run measures but does not optimise: a reward function or reward
model with weight 0 (``reward_weights``), seen on every step's samples as ``reward/<name>/mean``.
Once ``monitor_window`` steps are in, every step compares the newest half-window of steps with
an older one — the half-window just before it, or the run's first: it fires when the optimised
reward (``reward/mean``, the weighted score trained on) rose *and* a monitor fell, each by at
least :data:`T_MIN` standard errors of the difference (Welch's t over the per-step means) — the
shape of over-optimisation, a proxy climbing while the gold score it was meant to track peaks and
falls (Gao et al., "Scaling Laws for Reward Model Overoptimization", 2022). Both must move: a
monitor that drifts down while the reward is flat is no sign of hacking, nor is a reward rising
with its monitor. The first half-window is where the run started from: a fall that neighbouring
half-windows miss — once the reward sits at a plateau, or after a collapse of the reward
interrupted the climb (the RLHF example's β = 0 run did both) — is still measured against it
(a resumed run's first half-window is its first after the resume: the history is not kept).
And the fall must last: a step that passes makes a *candidate*, confirmed a window later only if
each of the next two half-windows — data the first test did not see — is again below the
candidate's older half by :data:`T_MIN` standard errors (and the reward above it); otherwise it
is dropped. A dip that a KL penalty pulls back (the RLHF example's KL runs dip for 8 to 20
steps, then rise past where they started) is so told apart from a sustained fall. Simulated with
a window of 20 over 300 steps, the reward rising linearly from 0 to 1 and both series with
Gaussian noise of σ = 0.05, 500 runs each, this rule against the one before it (the neighbouring
half only, confirmed by one half-window) warns on a monitor of pure noise in 0.2% of runs (0.4%),
on a 10-step dip of 4σ in 0.6% (1.2%), a 20-step dip in 16% (21%), and on a fall of 4σ that lasts
40 steps in 99% (25%: over 10 steps this reward rises by less than its noise).

It warns once per run, with the evidence (the two halves' means, their steps, and the three
samples of the last step that the optimised reward paid most for relative to the monitor), and
writes it to ``alarm.json`` in the run folder, which the report and ``posttrain view`` show.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.rollout.batch import RolloutBatch
from posttrain.telemetry.report import conversation_text

T_MIN = 3.0  # both changes at least this many standard errors, found and then confirmed
ALARM_FILE = "alarm.json"


class HackingAlarm:
    """Watches ``reward/mean`` against each monitor over a window of steps (module docstring)."""

    def __init__(self, monitors: Mapping[str, int], window: int, echo: Callable[[str], None], out: Path | None) -> None:
        # monitor name → its column in the batch's reward components
        self.monitors, self.window, self.echo, self.out = dict(monitors), window, echo, out
        self.steps: list[int] = []
        self.optimised: list[float] = []
        self.values: dict[str, list[float]] = {name: [] for name in monitors}
        # per monitor, a fall found and awaiting confirmation: (its step, the older half's slice)
        self.candidates: dict[str, tuple[int, slice]] = {}
        self.fired: bool | None = None  # read at the first step: a resumed run that warned keeps its alarm.json

    @classmethod
    def for_run(
        cls, names: Sequence[str], weights: Sequence[float], window: int, echo: Callable[[str], None], out: Path
    ) -> HackingAlarm | None:
        """The alarm of a run whose rewards are ``names`` with ``weights``; None without a monitor
        (no weight-0 reward beside one that is optimised) or with ``window`` 0."""
        monitors = {name: k for k, (name, w) in enumerate(zip(names, weights, strict=True)) if w == 0}
        if not window or not monitors or len(monitors) == len(names):
            return None
        return cls(monitors, window, echo, out)

    def observe(self, step: int, metrics: Mapping[str, float], batch: RolloutBatch | None = None) -> dict | None:
        """Take one step's metrics (and its batch, for the evidence); the alarm's record if it fires now."""
        if self.fired is None:  # the run folder is ready now (a new run's emptied, a resumed one's kept)
            self.fired = self.out is not None and (self.out / ALARM_FILE).is_file()
        optimised = metrics.get("reward/mean", math.nan)
        if self.fired or not math.isfinite(optimised):
            return None
        self.steps.append(step)
        self.optimised.append(optimised)
        for name in self.monitors:
            self.values[name].append(metrics.get(f"reward/{name}/mean", math.nan))
        if len(self.steps) < self.window:
            return None
        for name in self.monitors:
            record = self._check(name, batch)
            if record is not None:
                self._raise(record)
                return record
        return None

    def _check(self, name: str, batch: RolloutBatch | None) -> dict[str, Any] | None:
        """Confirm ``name``'s candidate (its record) or drop it, or make one; None unless confirmed."""
        half, count = self.window // 2, len(self.steps)
        if name in self.candidates:
            found, older = self.candidates[name]
            if count - 1 < found + 2 * half:  # the confirming window is not complete yet
                return None
            del self.candidates[name]
            halves = [slice(found + 1, found + 1 + half), slice(found + 1 + half, count)]
            rose, fell = (min(ts) for ts in zip(*(self._moves(name, older, newer) for newer in halves), strict=True))
            return self._record(name, older, halves[-1], rose, fell, found, batch) if min(rose, fell) >= T_MIN else None
        newer = slice(count - half, count)
        for older in (slice(count - 2 * half, count - half), slice(0, half)):  # the last half-window, the first
            if min(self._moves(name, older, newer)) >= T_MIN:
                self.candidates[name] = (count - 1, older)
                break
        return None

    def _moves(self, name: str, older: slice, newer: slice) -> tuple[float, float]:
        """Welch's t of the optimised reward's rise and of the monitor's fall from ``older`` to ``newer``."""
        monitor = self.values[name]
        return _welch_t(self.optimised[older], self.optimised[newer]), _welch_t(monitor[newer], monitor[older])

    def _record(
        self, name: str, older: slice, newer: slice, rose: float, fell: float, found: int, batch: RolloutBatch | None
    ) -> dict[str, Any]:
        steps = self.steps
        return {
            "step": steps[-1],
            "first_seen": steps[found],
            "monitor": {"name": name, **_halves(self.values[name], older, newer, fell)},
            "steps": {"before": [steps[older][0], steps[older][-1]], "after": [steps[newer][0], steps[newer][-1]]},
            "optimised": _halves(self.optimised, older, newer, rose),
            "samples": _evidence(batch, self.monitors[name]) if batch is not None else [],
        }

    def _raise(self, record: dict[str, Any]) -> None:
        self.fired = True
        monitor, (a, b) = record["monitor"], (record["steps"]["before"], record["steps"]["after"])
        name = monitor["name"]
        lines = [
            f"possible reward hacking: the optimised reward rose from {record['optimised']['before']:.4g} (steps "
            f"{a[0]}–{a[1]}) to {record['optimised']['after']:.4g} (steps {b[0]}–{b[1]}) while the monitor '{name}' "
            f"(weight 0, not optimised) fell from {monitor['before']:.4g} to {monitor['after']:.4g}. "
            "Look at what the reward pays for (posttrain view RUN_DIR); a KL penalty (algorithm.kl) or a fixed "
            "reward function usually cures it. Samples the reward paid most for against the monitor:",
        ]
        for sample in record["samples"]:
            text = sample["completion"][:160]
            lines.append(f"  score {sample['score']:.4g}, {name} {sample['monitor']:.4g}: {text!r}")
        self.echo("[warning] " + "\n".join(lines))
        if self.out is not None:
            (self.out / ALARM_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")


def _halves(values: list[float], older: slice, newer: slice, t: float) -> dict[str, float]:
    """The older and newer halves' means and the t of their change."""
    return {"before": statistics.fmean(values[older]), "after": statistics.fmean(values[newer]), "t": t}


def _welch_t(low: Sequence[float], high: Sequence[float]) -> float:
    """Welch's t of mean(high) − mean(low); 0 when either side has a NaN or fewer than 2 values."""
    if len(low) < 2 or len(high) < 2 or not all(math.isfinite(v) for v in [*low, *high]):
        return 0.0
    se = math.sqrt(statistics.variance(low) / len(low) + statistics.variance(high) / len(high))
    difference = statistics.fmean(high) - statistics.fmean(low)
    if se == 0.0:  # two flat halves: a real change is infinitely many standard errors
        return math.inf if difference > 0 else 0.0
    return difference / se


def _evidence(batch: RolloutBatch, column: int, count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` samples with the highest optimised score and the lowest monitor score (ranked
    by score minus monitor, each scaled to the batch's range)."""
    if batch.scores is None or batch.reward_components is None:
        return []
    scores, monitor = batch.scores, batch.reward_components[:, column]
    usable = (~scores.isnan() & ~monitor.isnan()).nonzero().flatten().tolist()

    def scaled(values: Any) -> Any:
        span = float(values.max() - values.min()) or 1.0
        return (values - values.min()) / span

    if not usable:
        return []
    gap = scaled(scores[usable]) - scaled(monitor[usable])
    order = gap.argsort(descending=True)[:count].tolist()
    picked = [usable[k] for k in order]
    return [
        {
            "score": float(scores[i]),
            "monitor": float(monitor[i]),
            "prompt": str(conversation_text(batch.prompts[i]))[:300],
            "completion": str(conversation_text(batch.completions[i]))[:500],
        }
        for i in picked
    ]
