"""Stopping on SIGTERM as a scheduler expects: at a step's end, with a checkpoint, within a grace.

Slurm (on preemption, ``scancel`` or the time limit) and Kubernetes send SIGTERM and, a grace
period later (Slurm's ``KillWait`` 30 s, Kubernetes' ``terminationGracePeriodSeconds`` 30 s),
SIGKILL. Python's default for SIGTERM is to die on the spot: no checkpoint of the work since the
last one, no report, the terminal's cursor left hidden. Here a training loop runs inside
:class:`StopOnSignal`: the signal only marks the run to stop; the loop asks at each step's end
(:meth:`StopOnSignal.stop_here`) and, when told to, saves a checkpoint of that step and raises
:class:`Stopped`. A step that does not end within ``stop_grace_s`` of the signal is abandoned (a
timer makes the signal handler raise :class:`Stopped` inside it); its work runs again on resume.
Either way the loop's ``finally`` blocks run (the report is written, the progress bar restores the
terminal) and the command line exits with status 143 (128 + SIGTERM), saying what was kept and
how to go on.

Under torchrun every rank asks the others at each step's end (one all-reduce of a flag), so all
stop after the same step, even when the signal reached one rank only, and none is left waiting
in a collective.

Covers: SIGTERM during a step, an evaluation or a checkpoint save (the save is atomic: a stopped
one leaves the previous checkpoint). Does not cover: SIGKILL, or a step stuck in native code
that never returns to the interpreter (the handler is Python's).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

DEFAULT_GRACE_S = 20.0  # under Slurm's and Kubernetes' 30 s default before SIGKILL


class Stopped(BaseException):
    """The run stopped on a signal. A BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` on the way (a reward's, an environment's) swallows it."""

    def __init__(self, signal_name: str, step: int | None, saved: Path | None) -> None:
        self.signal_name, self.step, self.saved = signal_name, step, saved
        where = f"after step {step}" if saved is not None else "during a step, which was abandoned"
        super().__init__(f"stopped by {signal_name} {where}")


class StopOnSignal:
    """SIGTERM handling for a training loop's life: :meth:`install` before the loop, :meth:`restore`
    in its ``finally`` (both no-ops off the main thread, where Python cannot install handlers).

    The grace is kept by a timer thread that, when it runs out, sends SIGTERM to the main thread
    again, whose handler then raises :class:`Stopped` wherever the step is (a real signal wakes a
    blocking wait, where a flag would not). No SIGALRM: a reward's own timeout may use that one."""

    def __init__(self, ranks: Any, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.ranks, self.grace_s = ranks, grace_s
        self.signal_name: str | None = None
        self.grace_over = False
        self._timer: threading.Timer | None = None
        self._previous: Any = None
        self._installed = False

    def install(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def restore(self) -> None:
        self._cancel_grace()
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        if self.signal_name is None:  # the first: stop at the step's end, or at the grace's
            self.signal_name = signal.Signals(number).name
            self._timer = threading.Timer(self.grace_s, self._end_of_grace)
            self._timer.daemon = True
            self._timer.start()
        elif self.grace_over:  # sent by _end_of_grace: the step did not end in time
            raise Stopped(self.signal_name, None, None)

    def _end_of_grace(self) -> None:
        self.grace_over = True
        if self._installed:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    def _cancel_grace(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def stop_here(self) -> bool:
        """At a step's end, on every rank: whether the run stops after this step (any rank's signal)."""
        return self.ranks.any(self.signal_name is not None)

    def stopped(self, step: int, saved: Path | None) -> Stopped:
        """The stop to raise once the step's checkpoint is saved (``saved``); the grace is over."""
        self._cancel_grace()
        return Stopped(self.signal_name or "SIGTERM", step, saved)
