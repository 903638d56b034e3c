"""The event loop a source's episodes run on: one loop in a daemon thread of its own, kept for the
source's life, watched from the caller's thread.

Why a thread of its own: an ``async def`` environment method is cancelled at its timeout only
when it yields to the loop; one that blocks it (``time.sleep`` inside ``async def``, a sync HTTP
call) cannot be interrupted, and on the caller's own loop it would hang the run forever. Here the
caller waits for the batch's result while pinging the loop; when a ping goes unanswered for the
environment's timeout, the run ends with :class:`EventLoopStalled` naming the call in progress.
Why one loop for the source's life: an async environment may keep an asyncio resource from
``reset`` to its last ``step`` (a client, a queue, a task it started), which belongs to the loop
it was made on.

Covers: an async call that never yields (detected within its timeout plus one ping interval).
Does not cover: freeing the blocked thread (Python cannot stop a thread; it is a daemon, so it
never holds up the interpreter's exit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from posttrain.errors import PosttrainError

T = TypeVar("T")
PING_S = 0.25  # how often the caller checks that the loop still turns


class EventLoopStalled(PosttrainError, RuntimeError):
    """An async environment method blocked the episodes' event loop past its timeout."""


class EpisodeLoop:
    """An event loop running in a daemon thread; :meth:`run` hands it a coroutine and waits."""

    def __init__(self, name: str = "episodes") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-event-loop", daemon=True)
        self.thread.start()
        self.stalled = False

    def run(self, coroutine: Coroutine[Any, Any, T], *, stall_s: float | None, what: str) -> T:
        """The coroutine's result, run on the loop; :class:`EventLoopStalled` when the loop answers no
        ping within ``stall_s`` seconds (None: wait however long it takes)."""
        if self.stalled:
            coroutine.close()
            raise EventLoopStalled(f"{what}: the episodes' event loop is still blocked by an earlier call")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        while True:
            try:
                return future.result(timeout=PING_S)
            except concurrent.futures.TimeoutError:
                pass
            if stall_s is not None and not self._answers_within(stall_s):
                self.stalled = True
                raise EventLoopStalled(
                    f"{what} blocked the episodes' event loop for more than {stall_s:g} s (env.timeout_s): an "
                    "`async def` method that never awaits — e.g. time.sleep or a blocking call inside it — cannot "
                    "be cancelled. Await instead (asyncio.sleep, an async client), or make the method a plain "
                    "`def`, which runs in a thread of its own and is abandoned at the timeout."
                )

    def _answers_within(self, seconds: float) -> bool:
        answered = threading.Event()
        self.loop.call_soon_threadsafe(answered.set)
        return answered.wait(seconds)

    def close(self) -> None:
        """Stop and close the loop (a stalled loop is left to its daemon thread)."""
        if self.stalled or self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()
