"""Worker processes for reward functions, so that a call that hangs or crashes costs only its
own samples, never the run.

Why processes: rule rewards are CPU-bound Python (sympy parsing math answers, regexes over
long completions) that threads run one at a time under the GIL; and a thread cannot be
stopped, so a call that never returns would hold the run forever. A process can be killed.

Why our own pool rather than ``concurrent.futures.ProcessPoolExecutor``: the executor cannot
cancel a task that has started, and one dead worker marks the whole executor broken, failing
every task in flight with no way to tell which task killed it. Here each worker runs one task
at a time, so a task that passes its timeout, or whose worker dies (segfault, ``os._exit``,
the OOM killer), loses exactly its own samples: the worker is killed together with its process
group (programs the function started go too), and a fresh one takes the next task.

How workers start: a fresh interpreter each (``subprocess``, the trainer's ``sys.path``),
never a fork of the trainer (forking a process that runs torch threads is unsafe), and not
through ``multiprocessing``'s fork server, which would leave a fork server and a resource
tracker alive for the rest of the trainer's life. A worker imports ``posttrain.rewards``
(~2 s, mostly torch) once, says it is ready, and is kept between calls; the timeout clock of
a task starts when a ready worker receives it. Workers are started on first use, or all at
once by :meth:`WorkerPool.start`.

Covers: calls that hang, workers that die, inputs or outputs that cannot be pickled (reported
as errors naming the reward), a trainer that dies (workers notice and exit). Does not cover:
untrusted code (that is the sandbox's job, ``sandbox.py``); state a function keeps between
calls (each worker has its own copy — keep such a function in the trainer's process with
``runs_in_process = True``); functions defined in the main script, which a worker does not
import (they run in a thread, see ``compose.py``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import itertools
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "crash"]
STARTUP_TIMEOUT_S = 120.0
"""A worker that is not ready after this long counts as a failed start."""
MAX_FAILED_STARTS = 3
"""Failed starts in a row after which tasks fail with the reason instead of waiting."""
_POLL_S = 1.0  # also look at the processes this often: a pipe shared with a grandchild shows no EOF
_BOOT = "import sys; sys.path[:] = {path!r}; from posttrain.rewards.pool import _worker_main; _worker_main({fd})"


@dataclass(frozen=True)
class Task:
    """One call of a pickled function on keyword arguments (one chunk of a batch).

    ``key`` names the function within the pool: each worker unpickles ``fn_bytes`` once and
    keeps the function under that key, so later calls only send the arguments.
    """

    key: int
    fn_bytes: bytes
    kwargs: dict[str, Any]
    timeout_s: float | None = None


@dataclass(frozen=True)
class TaskResult:
    """What became of a task: ``ok`` with the function's return value, or why not."""

    status: Status
    value: Any = None
    error: str = ""
    finished: float = field(default_factory=time.perf_counter)


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started: float = field(default_factory=time.perf_counter)
    ready: bool = False
    loaded: set[int] = field(default_factory=set)
    task: int | None = None
    key: int = -1
    deadline: float = math.inf


class WorkerPool:
    """Up to ``size`` worker processes running :class:`Task` s; see the module docstring."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {size}")
        self.size = size
        self.started = 0  # workers started so far, replacements included
        self._workers: list[_Worker] = []
        self._failed_starts, self._start_error = 0, ""
        self._lock = threading.Lock()
        # kill the workers when the pool is garbage collected without close()
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def start(self) -> None:
        """Start every worker now and wait until all are ready (so that the first call's time
        is the reward's own). Raises RuntimeError when workers fail to start."""
        with self._lock:
            while len(self._workers) < self.size:
                self._start()
            while any(not w.ready for w in self._workers) and self._failed_starts < MAX_FAILED_STARTS:
                self._step([], [])
            if self._failed_starts >= MAX_FAILED_STARTS:
                raise RuntimeError(f"reward worker processes fail to start: {self._start_error}")

    def run(self, tasks: Sequence[Task]) -> list[TaskResult]:
        """Run every task on the workers; results in task order. Never raises for what a
        task does: errors, timeouts and crashes come back as results."""
        with self._lock:
            results: list[TaskResult | None] = [None] * len(tasks)
            queue = deque(range(len(tasks)))
            while queue or any(w.task is not None for w in self._workers):
                self._dispatch(tasks, queue, results)
                self._step(tasks, results)
            return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers (idle ones exit when their pipe closes; busy ones are killed). The
        pool can still be used: later tasks start new workers."""
        self._finalizer()
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def _dispatch(self, tasks: Sequence[Task], queue: deque[int], results: list[TaskResult | None]) -> None:
        if self._failed_starts >= MAX_FAILED_STARTS:
            while queue:
                reason = f"could not run: its worker processes fail to start ({self._start_error})"
                results[queue.popleft()] = TaskResult("error", error=reason)
            return
        while queue:
            worker = next((w for w in self._workers if w.ready and w.task is None), None)
            if worker is None:
                starting = sum(not w.ready for w in self._workers)
                if len(self._workers) >= self.size or starting >= len(queue):
                    return
                self._start()
                continue
            index = queue.popleft()
            task = tasks[index]
            try:
                fn_bytes = None if task.key in worker.loaded else task.fn_bytes
                message = pickle.dumps((task.key, fn_bytes, task.kwargs))
            except Exception as error:
                results[index] = TaskResult("error", error=f"got inputs that cannot be sent to a worker: {_why(error)}")
                continue
            try:
                worker.conn.send_bytes(message)
            except OSError:  # it died while idle: not this task's fault, give it to another worker
                queue.appendleft(index)
                self._retire(worker)
                continue
            worker.task, worker.key = index, task.key
            worker.deadline = math.inf if task.timeout_s is None else time.perf_counter() + task.timeout_s

    def _step(self, tasks: Sequence[Task], results: list[TaskResult | None]) -> None:
        """Wait for the next reply, ready signal, death or deadline, and handle what came."""
        live = [w for w in self._workers if w.task is not None or not w.ready]
        if not live:
            return
        deadlines = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT_S for w in live]
        ready = wait([w.conn for w in live], min(_POLL_S, max(0.0, min(deadlines) - time.perf_counter())))
        now = time.perf_counter()
        for worker, deadline in zip(live, deadlines, strict=True):
            if worker.conn in ready:
                self._receive(worker, results)
            elif worker.process.poll() is not None:
                self._died(worker, results)
            elif now >= deadline:
                if worker.ready:
                    seconds = tasks[worker.task].timeout_s  # type: ignore[index]
                    results[worker.task] = TaskResult("timeout", error=f"no result after {seconds:g} s; worker killed")  # type: ignore[index]
                else:
                    self._failed_starts += 1
                    self._start_error = f"a worker was not ready after {STARTUP_TIMEOUT_S:g} s"
                self._retire(worker)

    def _receive(self, worker: _Worker, results: list[TaskResult | None]) -> None:
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):
            self._died(worker, results)
            return
        if not worker.ready:  # its first message: imports done, waiting for tasks
            worker.ready, self._failed_starts = True, 0
            return
        index, worker.task, worker.deadline = worker.task, None, math.inf
        assert index is not None
        try:
            status, detail = pickle.loads(data)  # strings, or the function's value
        except Exception as error:
            results[index] = TaskResult("error", error=f"returned a value the trainer cannot read ({_why(error)})")
            return
        if status == "load_error":
            worker.loaded.discard(worker.key)
            results[index] = TaskResult("error", error=detail)
            return
        worker.loaded.add(worker.key)
        results[index] = TaskResult("ok", value=detail) if status == "ok" else TaskResult("error", error=detail)

    def _died(self, worker: _Worker, results: list[TaskResult | None]) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(2.0)
        reason = _exit_reason(worker.process.returncode)
        if not worker.ready:
            self._failed_starts += 1
            self._start_error = f"a worker exited before it was ready ({reason}; its stderr says why)"
        elif worker.task is not None:
            results[worker.task] = TaskResult("crash", error=f"its worker died ({reason})")
        self._retire(worker)

    def _start(self) -> _Worker:
        parent_end, child_end = socket.socketpair()
        try:
            boot = _BOOT.format(path=sys.path, fd=child_end.fileno())
            process = subprocess.Popen(
                [sys.executable, "-c", boot],
                pass_fds=(child_end.fileno(),),
                start_new_session=True,  # its own process group, killed as one
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_end.close()  # so that the worker's death reads as end-of-file here
        worker = _Worker(process, Connection(parent_end.detach()))
        self._workers.append(worker)
        self.started += 1
        return worker

    def _retire(self, worker: _Worker) -> None:
        _kill(worker)
        self._workers.remove(worker)


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.conn.close()  # an idle worker reads end-of-file and exits
    for worker in workers:
        if worker.task is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(0.5)
        _kill(worker)
    workers.clear()


def _kill(worker: _Worker) -> None:
    if worker.process.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            worker.process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.process.wait(2.0)
    worker.conn.close()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------- inside a worker process


def _worker_main(fd: int) -> None:
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    faulthandler.enable()  # a segfault prints the Python stack to stderr
    _exit_with_parent()
    import torch

    import posttrain.rewards  # noqa: F401  (the built-ins, and torch, before the first task)

    torch.set_num_threads(1)  # the pool is the parallelism: N workers × all cores would oversubscribe

    functions: dict[int, Callable[..., Any]] = {}
    with contextlib.suppress(EOFError, OSError):  # the pool closed our pipe, or the trainer is gone
        conn.send_bytes(b"ready")
        while True:
            conn.send_bytes(_call(functions, conn.recv_bytes()))


def _call(functions: dict[int, Callable[..., Any]], data: bytes) -> bytes:
    """One task → the pickled reply ``(status, detail)``."""
    try:
        key, fn_bytes, kwargs = pickle.loads(data)
        if fn_bytes is not None:
            functions[key] = pickle.loads(fn_bytes)
        fn = functions[key]
    except BaseException as error:
        return pickle.dumps(("load_error", f"could not be loaded in a worker process ({_why(error)})"))
    try:
        value = fn(**kwargs)
    except BaseException as error:  # SystemExit too: sys.exit() in a reward is its error
        return pickle.dumps(("error", f"raised {_why(error)} in a worker process\n{traceback.format_exc()}"))
    try:
        return pickle.dumps(("ok", value))
    except BaseException as error:
        return pickle.dumps(("error", f"returned a value that cannot be sent back from its worker ({_why(error)})"))


def _exit_with_parent() -> None:
    """Exit when the trainer is gone, also in the middle of a call that never returns.
    (PR_SET_PDEATHSIG would fire when the trainer *thread* that started us ends.)"""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# ---------------------------------------------------------------- helpers for the caller


def pickled_function(fn: Callable[..., Any]) -> tuple[bytes | None, str]:
    """``(bytes, "")`` when ``fn`` can run in a worker process, else ``(None, why not)``."""
    owner = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    if getattr(owner, "__module__", None) == "__main__":
        return None, "it is defined in the main script or session, which worker processes do not import"
    try:
        data = pickle.dumps(fn)
        pickle.loads(data)
    except Exception as error:
        return None, f"it cannot be pickled ({_why(error)})"
    return data, ""


class Deferred:
    """A function that a worker builds on its first call, from a picklable factory and its
    arguments: for objects that cannot be pickled (they hold a lock or an open handle) but can
    be built again. Each worker keeps the one it built."""

    def __init__(self, factory: Callable[..., Callable[..., Any]], *args: Any) -> None:
        self.factory, self.args = factory, args
        self._fn: Callable[..., Any] | None = None

    def __call__(self, **kwargs: Any) -> Any:
        if self._fn is None:
            self._fn = self.factory(*self.args)
        return self._fn(**kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self.factory, "args": self.args, "_fn": None}


def split_batch(size: int, chunks: int) -> list[slice]:
    """``size`` rows → at most ``chunks`` contiguous slices whose lengths differ by at most 1,
    in order (so concatenating the chunks' values restores the batch order)."""
    chunks = max(1, min(chunks, size))
    base, extra = divmod(size, chunks)
    bounds = [0]
    for i in range(chunks):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def slice_kwargs(kwargs: Mapping[str, Sequence[Any]], part: slice) -> dict[str, Any]:
    """The rows ``part`` of every column (prompts, completions, completion_ids, dataset columns)."""
    return {key: values[part] for key, values in kwargs.items()}


def call_in_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run ``fn`` in a new daemon thread. Unlike a ThreadPoolExecutor's threads, which the
    interpreter joins at exit, an abandoned call that never returns cannot keep the process alive."""
    future: Future = Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


def default_workers() -> int:
    """One worker per CPU core this process may use, at most 8 (rule rewards are short calls;
    beyond that, sending the batch costs more than it saves)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))
