"""Run correct programs through one ``Sandbox`` from four threads while this process plays the
machine's init, reaping the orphaned jail inits late or never; print the verdicts as JSON.

Why a separate process: bwrap's monitor exits as soon as the program's status arrives and leaves
the namespace's init to be reaped by the nearest subreaper, normally the machine's pid 1. Until
then its zombie stays charged to the run's pids cgroup. Some machines' pid 1 reaps in batches
seconds apart (seen: a firecracker VM's init, 135 jail-init zombies waiting at once), which is
what broke the code reward under parallel load. Becoming a subreaper (PR_SET_CHILD_SUBREAPER)
makes this process that init, so the test chooses how slowly it reaps.

Usage: python -m tests.rewards.sandbox.reaper_load RUNS REAP_EVERY_S [MAX_KEPT]
(REAP_EVERY_S 0: never reap; MAX_KEPT: the pool's bound on run cgroups, default the module's).
After the load, one program counts the children it can fork: the cap a run gets then.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from posttrain.rewards import sandbox_cgroup
from posttrain.rewards.sandbox import Sandbox

from .conftest import LIMITS

PR_SET_CHILD_SUBREAPER = 36

# forks sleeping children until the pids cgroup refuses one; prints how many it got
FORK_PROBE = """
import os, time
count = 0
while count < 1000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    count += 1
print(count)
"""


def forks_allowed(box: Sandbox) -> int:
    """Children one run can fork (its cap minus the jail's own tasks), or -1 when it did not run."""
    result = box.run_io(FORK_PROBE, "", "")
    out = result.stdout.decode().strip()
    return int(out) if out.isdigit() else -1


def orphaned_jail_inits() -> list[int]:
    """Zombie children of this process that live in a pid namespace of their own (a jail's init;
    the direct children that supervise() waits for are in ours and are left to it)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if (
            fields.get("PPid", "").strip() == str(os.getpid())
            and fields.get("State", "").strip().startswith("Z")
            and len(fields.get("NSpid", "").split()) > 1
        ):
            found.append(int(pid))
    return found


def reap_every(seconds: float, stop: threading.Event) -> None:
    while not stop.wait(seconds):
        for pid in orphaned_jail_inits():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def one_run(box: Sandbox, i: int) -> tuple[str, str]:
    if i % 2 == 0:
        result = box.run_io("print(sum(map(int, input().split())))", f"{i} 1", str(i + 1))
        return result.verdict.value, result.detail
    results = box.run_asserts("def f(x):\n    return 2 * x", [f"assert f({i}) == {2 * i}", "assert f(0) == 0"])
    bad = [r for r in results if r.verdict.value != "pass"]
    return (bad[0].verdict.value, bad[0].detail) if bad else ("pass", "")


def main() -> None:
    runs, every = int(sys.argv[1]), float(sys.argv[2])
    if len(sys.argv) > 3:
        sandbox_cgroup.MAX_KEPT = int(sys.argv[3])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    box = Sandbox(LIMITS)
    stop = threading.Event()
    if every > 0:
        threading.Thread(target=reap_every, args=(every, stop), daemon=True).start()
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda i: one_run(box, i), range(runs)))
    forks = forks_allowed(box)
    stop.set()
    verdicts = collections.Counter(verdict for verdict, _ in outcomes)
    details = sorted({detail[:200] for verdict, detail in outcomes if verdict != "pass"})[:5]
    waiting = len(orphaned_jail_inits())
    report = {"verdicts": verdicts, "details": details, "containment": box.containment, "forks_allowed": forks}
    report |= {"unreaped_at_end": waiting, "seconds": round(time.monotonic() - start, 1)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
