"""A progress display: a live bar on a terminal, plain periodic lines in logs and CI."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.text import Text


class _BarThenMetrics(RichProgress):
    """A rich progress bar with the metrics on a line of their own below it: the step counter
    and the ETA then fit an 80-column terminal whatever the metrics, which are cut at its edge."""

    metrics = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.metrics:
            yield Text(self.metrics, no_wrap=True, overflow="ellipsis", style="dim")


class Progress:
    """Shows step, elapsed time, ETA and a few key metrics.

    ``keys`` picks the metrics shown (e.g. ``["reward/mean", "loss/policy"]``). When stdout is
    not a terminal a line is printed every ``every`` steps instead of redrawing a bar, so
    log files stay readable.
    """

    def __init__(
        self,
        total: int,
        *,
        keys: Sequence[str] = (),
        every: int = 10,
        label: str = "train",
        start: int = 0,
        live: bool | None = None,
    ) -> None:
        self.total, self.keys, self.every, self.label = total, list(keys), max(1, every), label
        self.start_step = start
        self.live = sys.stdout.isatty() if live is None else live
        self._started = time.perf_counter()
        self._bar: RichProgress | None = None
        if self.live:
            self._bar = _BarThenMetrics(
                TextColumn(f"[bold]{label}"),
                BarColumn(bar_width=None),  # the bar takes what the counter and times leave
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                expand=True,
            )
            self._task = self._bar.add_task(label, total=total, completed=start)
            self._bar.start()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = "  ".join(f"{k} {metrics[k]:.4g}" for k in self.keys if k in metrics)
        if self._bar is not None:
            self._bar.metrics = shown
            self._bar.update(self._task, completed=step)
        elif step % self.every == 0 or step == self.total:
            print(f"[{self.label}] step {step}/{self.total}  {shown}  {self._timing(step)}", flush=True)

    def _timing(self, step: int) -> str:
        elapsed = time.perf_counter() - self._started
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        return f"elapsed {elapsed:.0f} s  eta {eta:.0f} s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
