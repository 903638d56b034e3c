"""Start one jailed process, feed it its payload, collect capped output, enforce the wall time,
and make sure nothing it started outlives the run.

The caller builds the command (``bwrap ...`` or, in unsafe local mode, the bare interpreter);
this module only supervises. No ``preexec_fn``: it is not safe with the reward's worker threads
(a forked child can deadlock on a lock another thread held), so the per-run cgroup is joined by a
``sh`` wrapper that writes its own pid and then ``exec``s the command.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from posttrain.rewards.sandbox_cgroup import RunCgroup

# `sh -c JOIN sh N FILE_1 .. FILE_N CMD ARGS..`: join N cgroups, then become CMD
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
_CHUNK = 1 << 16


@dataclass
class Supervised:
    """What one process did, as seen from outside."""

    stdout: bytes
    stderr: bytes
    exit_code: int | None  # None when a signal ended it
    signal: int | None
    timed_out: bool  # the wall time ran out and we killed it
    output_exceeded: bool  # stdout + stderr passed the cap and we killed it
    cpu_s: float  # user + system time of the process and its reaped descendants
    wall_s: float
    oom_killed: bool  # the run's memory cgroup killed a task


def supervise(
    argv: list[str],
    stdin: bytes,
    *,
    env: dict[str, str],
    cwd: str,
    wall_s: float,
    output_cap: int,
    cgroup: RunCgroup | None,
) -> Supervised:
    """Run ``argv`` until it exits, the wall time runs out or the output passes ``output_cap``.
    On return no task of the run is alive (the process group and the cgroup are SIGKILLed)."""
    if cgroup is not None:
        files = cgroup.procs_files
        argv = ["/bin/sh", "-c", _JOIN, "sh", str(len(files)), *files, *argv]
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        close_fds=True,
        start_new_session=True,  # its own process group, killed as one
    )
    try:
        outcome = _pump(proc, stdin, start + wall_s, output_cap)
    finally:
        _kill_group(proc.pid)
        if cgroup is not None:
            cgroup.kill_all()
        _await_eof(proc, timeout_s=1.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # keeps Popen.__del__ quiet
    stdout, stderr, timed_out, exceeded = outcome
    return Supervised(
        stdout=stdout,
        stderr=stderr,
        exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        timed_out=timed_out,
        output_exceeded=exceeded,
        cpu_s=usage.ru_utime + usage.ru_stime,
        wall_s=time.monotonic() - start,
        oom_killed=cgroup.oom_killed() if cgroup is not None else False,
    )


def _pump(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Write stdin, read stdout/stderr, watch the process exit (pidfd) until done or a limit."""
    assert proc.stdin and proc.stdout and proc.stderr
    selector = selectors.DefaultSelector()
    pidfd = os.pidfd_open(proc.pid)
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pending = memoryview(stdin)
    try:
        selector.register(pidfd, selectors.EVENT_READ, "exit")
        for fd in out:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, "read")
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "write")
        else:
            proc.stdin.close()
        exited_at: float | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                return bytes(out[proc.stdout.fileno()]), bytes(out[proc.stderr.fileno()]), True, False
            readers = [k for k in selector.get_map().values() if k.data == "read"]
            # once it exited, give descendants holding the pipes a moment, then stop waiting
            if exited_at is not None and (not readers or now - exited_at > 0.2):
                break
            for key, _ in selector.select(deadline - now if exited_at is None else 0.05):
                if key.data == "exit":
                    exited_at = time.monotonic()
                    selector.unregister(pidfd)
                elif key.data == "write":
                    try:
                        pending = pending[os.write(key.fd, pending[:_CHUNK]) :]
                    except (BrokenPipeError, BlockingIOError) as error:
                        if isinstance(error, BlockingIOError):
                            continue
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(key.fd)
                        proc.stdin.close()
                else:
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    out[key.fd] += chunk
                    if sum(len(b) for b in out.values()) > cap:
                        return bytes(out[proc.stdout.fileno()]), bytes(out[proc.stderr.fileno()]), False, True
        return bytes(out[proc.stdout.fileno()]), bytes(out[proc.stderr.fileno()]), False, False
    finally:
        selector.close()
        os.close(pidfd)


def _await_eof(proc: subprocess.Popen, timeout_s: float) -> None:
    """Discard output until both pipes close. The jail's init holds them and exits only after
    the kernel has reaped every task of its pid namespace, so EOF means the jail is empty —
    the guarantee where no cgroup can be emptied for us (a big fork bomb takes a while)."""
    assert proc.stdout and proc.stderr
    fds = [f.fileno() for f in (proc.stdout, proc.stderr) if not f.closed]
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                try:
                    if not os.read(key.fd, _CHUNK):
                        selector.unregister(key.fd)
                except BlockingIOError:
                    pass


def _kill_group(pgid: int) -> None:
    # with the jail, killing bwrap kills its pid namespace's init (--die-with-parent), and the
    # kernel then kills every task of the namespace, double-forked daemons included
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
