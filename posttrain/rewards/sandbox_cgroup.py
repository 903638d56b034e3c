"""Per-run cgroups for the sandbox: a cap on processes (pids) and on total memory.

Why cgroups: RLIMIT_NPROC does not hold a fork bomb here. The kernel exempts root
(``INIT_USER``), even inside the jail's user namespace, and for other users it counts *all*
their tasks, the trainer's threads included. A pids cgroup counts exactly the run's tasks.

One cgroup per run at a time, under this process's own cgroup (so any limit the machine puts
on the trainer still applies), joined by a tiny ``sh`` wrapper before ``bwrap`` starts (so no
task of the run is ever outside it) and emptied with SIGKILL when the run ends. Emptied
cgroups are kept for the next run: removing a used memory cgroup can take ~10 ms of kernel
work, a third of a whole jailed run.

A kept cgroup is handed to the next run only once nothing is charged to it (``pids.current``
is 0). An emptied cgroup is not yet free: bwrap's monitor exits as soon as the program's exit
status arrives, without waiting for the namespace's init, which is then reparented to the
machine's pid 1; its zombie stays charged to the run's pids cgroup until that init reaps it.
Some inits reap in batches seconds apart (seen: a firecracker VM, 135 jail inits waiting at
once under four threads), so reusing a cgroup at once let these charges pile up past the cap
and the next jail could not fork its own init — an ``infra_error``, or a ``crash`` when the
referee could not spawn its worker. Charged cgroups wait in the pool while new ones are made.
Where the machine's init never reaps, past ``MAX_KEPT`` cgroups the least-charged one is taken
with its cap raised by the stale charge (a warning says so once): zombies run nothing, so the
run's own tasks still get their full cap, bounded as before.

Both layouts are handled: cgroup v1 (a ``pids`` and a ``memory`` hierarchy) and v2 (one
unified hierarchy; our own cgroup must be allowed to enable ``pids`` for its children, which
holds at the root of a container's cgroup namespace or in a delegated subtree). Where neither
is writable, :func:`detect` returns None and the caller says so at start-up.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_runs = itertools.count()
_pools = itertools.count()

MAX_KEPT = 256
"""Run cgroups a pool holds at most; past it a still-charged one is reused (see above)."""


@dataclass
class RunCgroup:
    """The cgroup directories of one run (one per v1 hierarchy, or one v2 directory)."""

    dirs: list[str]
    memory_events: str | None  # file whose "oom_kill N" line counts OOM kills, if memory is limited
    oom_base: int = 0  # the count when this run began (the counter is cumulative)

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError), open(path) as f:
                found.update(int(line) for line in f if line.strip())
        return found

    def charged(self) -> int:
        """Tasks charged to the pids cgroup: live ones and zombies not yet reaped (-1: unreadable)."""
        try:
            with open(os.path.join(self.dirs[0], "pids.current")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return -1

    def oom_kills(self) -> int:
        if self.memory_events is None:
            return 0
        with contextlib.suppress(OSError, ValueError), open(self.memory_events) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def oom_killed(self) -> bool:
        """The memory limit killed a task during this run."""
        return self.oom_kills() > self.oom_base

    def kill_all(self, timeout_s: float = 2.0) -> bool:
        """SIGKILL every task until the cgroup is empty; True when it is."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):  # rmdir fails (EBUSY) until the last task is fully gone
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


@dataclass
class CgroupPool:
    """Where per-run cgroups are made. ``pids_root`` and ``memory_root`` are parent directories
    owned by this process; on v2 they are the same directory."""

    version: int
    pids_root: str
    memory_root: str | None
    made: list[str] = field(default_factory=list)
    free: list[RunCgroup] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    run_cgroups: int = 0  # made and not removed: in use or kept in ``free``
    warned_unreaped: bool = False

    @property
    def description(self) -> str:
        parts = "pids" + ("+memory" if self.memory_root else "")
        return f"cgroup v{self.version} ({parts}) under {self.pids_root}"

    def acquire(self, max_tasks: int, memory_bytes: int) -> RunCgroup:
        """An empty cgroup with these limits: a kept one with nothing charged, else a new one
        (else, at ``MAX_KEPT``, the least-charged kept one with the stale charge added to its cap)."""
        cgroup, stale = self._take_uncharged()
        if cgroup is None:
            return self.create(max_tasks, memory_bytes)
        try:
            self._set_limits(cgroup, max_tasks + stale, memory_bytes)
        except OSError:
            self._forget(cgroup)
            raise
        cgroup.oom_base = cgroup.oom_kills()
        return cgroup

    def release(self, cgroup: RunCgroup) -> None:
        """Kill what is left of the run; keep the cgroup for a later run when it is empty."""
        if cgroup.kill_all():
            with self.lock:
                self.free.append(cgroup)
        else:
            self._forget(cgroup)

    def _take_uncharged(self) -> tuple[RunCgroup | None, int]:
        """(a kept cgroup, its stale charge), or (None, 0) when a new one should be made. The
        oldest kept cgroups come first: their zombies have had the longest to be reaped."""
        with self.lock:
            for index, cgroup in enumerate(self.free):
                if cgroup.charged() == 0:
                    return self.free.pop(index), 0
            if not self.free or self.run_cgroups < MAX_KEPT:
                self.run_cgroups += 1  # reserved under the lock; create() makes it
                return None, 0
            # an unreadable count (-1) sorts last: it would hide how many slots are taken
            stale, index = min((c if c >= 0 else 1 << 30, i) for i, c in enumerate(g.charged() for g in self.free))
            warn, self.warned_unreaped = not self.warned_unreaped, True
            cgroup = self.free.pop(index)
        if warn:
            log.warning(
                "code sandbox: %d run cgroups all still hold unreaped processes (zombies of jail inits the "
                "machine's pid 1 has not reaped); reusing them with the process cap raised by the stale count",
                MAX_KEPT,
            )
        return cgroup, stale if stale < 1 << 30 else 0

    def _forget(self, cgroup: RunCgroup) -> None:
        cgroup.remove()
        with self.lock:
            self.run_cgroups -= 1

    def _set_limits(self, cgroup: RunCgroup, max_tasks: int, memory_bytes: int) -> None:
        _write(os.path.join(cgroup.dirs[0], "pids.max"), str(max_tasks))
        if self.version == 2 and self.memory_root:
            _write(os.path.join(cgroup.dirs[0], "memory.max"), str(memory_bytes))
        elif self.memory_root:
            _write(os.path.join(cgroup.dirs[1], "memory.limit_in_bytes"), str(memory_bytes))

    def create(self, max_tasks: int, memory_bytes: int) -> RunCgroup:
        """A new run cgroup; its place in ``run_cgroups`` was reserved by the caller."""
        try:
            return self._make_run_cgroup(max_tasks, memory_bytes)
        except OSError:
            with self.lock:
                self.run_cgroups -= 1
            raise

    def _make_run_cgroup(self, max_tasks: int, memory_bytes: int) -> RunCgroup:
        name = f"run-{next(_runs)}"
        pids_dir = os.path.join(self.pids_root, name)
        os.mkdir(pids_dir)
        dirs, events = [pids_dir], None
        try:
            _write(os.path.join(pids_dir, "pids.max"), str(max_tasks))
            if self.version == 2 and self.memory_root:
                _write(os.path.join(pids_dir, "memory.max"), str(memory_bytes))
                _write_if_present(os.path.join(pids_dir, "memory.swap.max"), "0")
                events = os.path.join(pids_dir, "memory.events")
            elif self.memory_root:
                memory_dir = os.path.join(self.memory_root, name)
                os.mkdir(memory_dir)
                dirs.append(memory_dir)
                _write(os.path.join(memory_dir, "memory.limit_in_bytes"), str(memory_bytes))
                events = os.path.join(memory_dir, "memory.oom_control")
        except OSError:
            RunCgroup(dirs, None).remove()
            raise
        return RunCgroup(dirs, events)

    def close(self) -> None:
        with self.lock:
            kept, self.free = self.free, []
            self.run_cgroups -= len(kept)
        for cgroup in kept:
            cgroup.remove()
        for d in self.made:
            with contextlib.suppress(OSError):
                os.rmdir(d)


def detect() -> CgroupPool | None:
    """A writable pids controller (v1 first, then v2) with a probe run created and removed;
    None when there is none."""
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    tag = f"posttrain-sandbox-{os.getpid()}-{next(_pools)}"
    candidates = []
    if "pids" in mounts:
        memory = os.path.join(mounts["memory"], own.get("memory", "/").lstrip("/"), tag) if "memory" in mounts else None
        candidates.append((1, os.path.join(mounts["pids"], own.get("pids", "/").lstrip("/"), tag), memory))
    if "" in mounts:
        base = os.path.join(mounts[""], own.get("", "/").lstrip("/"))
        candidates.append((2, os.path.join(base, tag), os.path.join(base, tag)))
    for version, pids_root, memory_root in candidates:
        pool = _try_pool(version, pids_root, memory_root)
        if pool is not None:
            return pool
    return None


def _remove_stale(parent: str) -> None:
    """Empty pool directories left by trainers that died without running their atexit."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith("posttrain-sandbox-"):
                continue
            pid = name.split("-")[2]
            if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                continue
            pool = os.path.join(parent, name)
            for child in os.listdir(pool):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(pool, child))  # fails, harmlessly, unless empty
            with contextlib.suppress(OSError):
                os.rmdir(pool)


def _try_pool(version: int, pids_root: str, memory_root: str | None) -> CgroupPool | None:
    for root in (pids_root, memory_root):
        if root:
            _remove_stale(os.path.dirname(root))
    made: list[str] = []
    try:
        if version == 2:
            # a controller reaches a cgroup only when each ancestor enables it for its children
            _enable_v2(os.path.dirname(pids_root))
            _make(pids_root, made)
            _enable_v2(pids_root)
            with open(os.path.join(pids_root, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    memory_root = None
        else:
            _make(pids_root, made)
            if memory_root:
                try:
                    _make(memory_root, made)
                except OSError:
                    memory_root = None
        pool = CgroupPool(version, pids_root, memory_root if version == 1 else (pids_root if memory_root else None))
        pool.made = made[::-1]
        pool.release(pool.acquire(max_tasks=4, memory_bytes=64 << 20))  # the probe: every write we need
        return pool
    except OSError:
        for d in made[::-1]:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        return None


def _enable_v2(directory: str) -> None:
    """pids (required) and memory (when it can be had) for the children of ``directory``."""
    path = os.path.join(directory, "cgroup.subtree_control")
    for wanted in ({"pids", "memory"}, {"pids"}):
        with open(path) as f:
            missing = wanted - set(f.read().split())
        try:
            if missing:
                _write(path, " ".join(f"+{c}" for c in sorted(missing)))
            return
        except OSError:
            if wanted == {"pids"}:
                raise


def _make(path: str, made: list[str]) -> None:
    os.mkdir(path)
    made.append(path)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _write_if_present(path: str, value: str) -> None:
    if os.path.exists(path):
        _write(path, value)


def _cgroup_mounts() -> dict[str, str]:
    """controller → mount point for v1 ("pids", "memory"), and "" → the v2 mount point."""
    mounts: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            point, fstype, options = fields[4], tail[0], tail[2].split(",")
            if fstype == "cgroup2":
                mounts.setdefault("", point)
            elif fstype == "cgroup":
                for controller in ("pids", "memory"):
                    if controller in options:
                        mounts.setdefault(controller, point)
    return mounts


def _own_cgroups() -> dict[str, str]:
    """controller → this process's cgroup path ("" for v2)."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own
