"""Reward workers as Ray tasks (``cluster.kind: ray`` with ``reward_workers`` ≥ 1).

:class:`RayTaskPool` has :class:`~posttrain.rewards.pool.WorkerPool`'s interface, so
``RewardSet`` scores the same way: the pooled functions' chunks become Ray tasks, at most
``size`` at a time, placed by Ray anywhere in the cluster (a code reward's sandboxed programs
then run on the cluster's nodes rather than the learner's). What a task does never raises here:
an error comes back as its result, a task past its timeout is cancelled (its process killed)
and reported as ``timeout``, a task whose worker process died as ``crash`` — each costing only its
own samples, as in the local pool. Functions are sent pickled with the learner's ``sys.path``,
which a task adds to its own, so a reward defined in the learner's project imports on a local
cluster; on other machines its module must be installed there too.
"""

from __future__ import annotations

import math
import pickle
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from posttrain.rewards.pool import Task, TaskResult, _call
from posttrain.rollout.ray_engine import import_ray

STALL_CHECK_S = 30.0  # how often a run waiting on its reward tasks checks for a cluster without free CPUs


def _run_task(paths: list[str], key: int, fn_bytes: bytes, kwargs: dict[str, Any]) -> bytes:
    """The remote side of one task: the pickled reply ``(status, detail)`` of the local pool."""
    import torch

    torch.set_num_threads(1)  # the tasks are the parallelism
    sys.path.extend(path for path in paths if path not in sys.path)
    return _call({}, pickle.dumps((key, fn_bytes, kwargs)))


class RayTaskPool:
    """Up to ``size`` reward tasks at a time on a Ray cluster (joined by the Ray rollout workers,
    or started here when none is); see the module docstring."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {size}")
        self.size, self.started = size, 0
        self.ray = import_ray()
        self._remote: Any = None
        self._warned = False

    def start(self) -> None:
        if not self.ray.is_initialized():
            self.ray.init(include_dashboard=False, log_to_driver=False)
        if self._remote is None:
            self._remote = self.ray.remote(num_cpus=1, max_retries=0)(_run_task)

    def run(self, tasks: Sequence[Task]) -> list[TaskResult]:
        """Every task on the cluster; results in task order (errors, timeouts, crashes included)."""
        self.start()
        ray, paths = self.ray, list(sys.path)
        results: list[TaskResult | None] = [None] * len(tasks)
        waiting = list(range(len(tasks)))
        running: dict[Any, tuple[int, float]] = {}  # ref → (task index, deadline)
        while waiting or running:
            while waiting and len(running) < self.size:
                index = waiting.pop(0)
                task = tasks[index]
                ref = self._remote.remote(paths, task.key, task.fn_bytes, task.kwargs)
                deadline = time.perf_counter() + task.timeout_s if task.timeout_s is not None else math.inf
                running[ref] = (index, deadline)
                self.started += 1
            nearest = min(deadline for _, deadline in running.values())
            wait_s = min(STALL_CHECK_S, max(0.0, nearest - time.perf_counter()))  # inf: the check's period
            done, _ = ray.wait(list(running), num_returns=1, timeout=wait_s)
            if not done:
                self._check_stall()
            for ref in done:
                index, _ = running.pop(ref)
                results[index] = _result(ray, ref)
            now = time.perf_counter()
            for ref, (index, deadline) in list(running.items()):
                if deadline <= now:
                    ray.cancel(ref, force=True)
                    running.pop(ref)
                    results[index] = TaskResult("timeout", error=f"did not finish within {tasks[index].timeout_s:g} s")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Nothing to stop: tasks end with their calls; the cluster is the rollout engine's."""

    def _check_stall(self) -> None:
        """Say so, once, when tasks wait because the cluster has no CPU free for them (the rollout
        workers reserve theirs): a cluster too small for the run would otherwise just hang."""
        if self._warned or self.ray.available_resources().get("CPU", 0.0) >= 1:
            return
        self._warned = True
        total = self.ray.cluster_resources().get("CPU", 0.0)
        warnings.warn(
            f"reward tasks are waiting for a free CPU on the Ray cluster (all {total:g} are reserved, e.g. by "
            "the rollout workers): add CPUs to the cluster, lower cluster.rollout_workers or worker_threads, or "
            "set reward_workers: 0 to score in the learner's threads",
            RuntimeWarning,
            stacklevel=2,
        )


def _result(ray: Any, ref: Any) -> TaskResult:
    try:
        status, detail = pickle.loads(ray.get(ref))
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.TaskCancelledError) as error:
        return TaskResult("crash", error=f"its Ray worker died ({type(error).__name__})")
    except ray.exceptions.RayError as error:
        return TaskResult("error", error=f"failed on the Ray cluster ({str(error).strip().splitlines()[0]})")
    if status == "ok":
        return TaskResult("ok", value=detail)
    return TaskResult("error", error=detail)
