"""A jail for running model-written programs against test cases, and the verdicts it gives.

Covers (checked by the hostile corpus in ``tests/rewards/sandbox``):

- writes outside the jail: the system (``/usr`` and the ``/lib*``, ``/bin`` links) and the
  interpreter's install prefix are bound read-only; the jail's root, ``/dev`` and ``/proc``
  are remounted read-only (``/proc`` because a trainer run as root makes the jail uid 0 on the
  host, and host-wide sysctls such as ``kernel/core_pattern`` check only the uid); the only
  writable places are a private, size-capped ``/tmp`` and ``/dev/shm``, which vanish with the
  run. The working directory, the dataset and ``$HOME`` are never bound (a program that can
  read the dataset can print the expected outputs).
- host secrets: the environment is cleared (also for ``bwrap`` itself, whose ``/proc/1/environ``
  the program can read), nothing under ``$HOME`` or ``/etc`` is visible but ``ld.so.cache``.
- network: a new, empty network namespace (loopback only), so no connection leaves the jail,
  abstract Unix sockets included.
- other processes: new pid, IPC, UTS, user and cgroup namespaces; all capabilities dropped;
  ``--new-session`` (no TIOCSTI into the trainer's terminal); ``--die-with-parent``.
- resources: wall time (killed by us), CPU time, address space, file size, open files, core
  dumps (rlimits set before the program's first line), tasks (a pids cgroup per run where one is
  writable) and total memory (a memory cgroup, where writable), output bytes (killed when over).
  Every task of a run is dead when the run returns: killing ``bwrap`` kills the pid namespace's
  init, and the kernel then kills everything in the namespace; the cgroup is emptied as well.
- forged verdicts: stdin/stdout cases are judged here from the exit status and stdout;
  assert-style tests run in a separate referee process that never runs program code (see
  ``sandbox_harness.py``), so patched builtins, always-equal objects, stack inspection and an
  early ``exit`` cannot turn into passes.

Does not cover:

- kernel bugs: no seccomp filter, so the program reaches the whole syscall surface of the
  kernel, user namespaces included; a kernel exploit escapes. Run the trainer as a non-root
  user on a machine you can lose.
- a trainer run as root: the jail's processes are then host uid 0 inside a user namespace,
  with no capabilities. Every write surface is read-only or private, but root-only files
  inside the bound ``/usr`` and interpreter prefix are readable, and any kernel interface
  that checks the uid alone is reachable (warned about at start-up). All runs share one uid.
- the jail's own init (``bwrap``, pid 1 inside): the program can ptrace it or open its fds.
  It holds nothing secret (its environment is emptied, its stdin is drained before the program
  starts, its stdout is the program's own), and the referee ignores lines without its nonce.
- side channels and information the kernel shares: CPU model, ``/proc/meminfo``, uptime,
  timing; and the host's CPU and memory bandwidth are shared (one program can slow another).
- fork bombs where no pids cgroup is writable and the trainer runs as root: RLIMIT_NPROC does
  not apply to root, so only the pid namespace and the wall-time kill contain them (said at
  start-up).
- ``unsafe_local=True``: no jail at all, only rlimits, a temporary working directory and a
  cleared environment. For debugging on a machine without user namespaces.

Verdicts (one per test case, fixed list ``Verdict``): ``pass``; ``fail`` (wrong output, a failed
assert, a test that tripped over a wrong or missing result); ``timeout`` (wall or CPU time);
``memory`` (MemoryError, or the memory cgroup killed a task); ``crash`` (non-zero exit, a signal,
an exception raised by the program, the program exiting before the tests ran, output over the
cap, any other limit); ``infra_error`` (the jail did not start or the runner itself failed —
never the program's fault, and never a score).
"""

from __future__ import annotations

import atexit
import json
import logging
import marshal
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from posttrain.errors import PosttrainError
from posttrain.rewards import sandbox_cgroup
from posttrain.rewards.sandbox_process import Supervised, supervise

log = logging.getLogger(__name__)

_HARNESS = Path(__file__).with_name("sandbox_harness.py").read_text()
_MiB = 1 << 20
_OVERHEAD_TASKS = 4  # sh/bwrap, the namespace's init, the harness (and in assert mode, its worker)
_OVERHEAD_MEMORY = 64 * _MiB


class Verdict(str, Enum):
    """The fixed list of outcomes of one test case."""

    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    CRASH = "crash"
    INFRA_ERROR = "infra_error"


@dataclass(frozen=True)
class Limits:
    """Per-run limits. A stdin/stdout case is one run; all assert tests of a program share one."""

    wall_s: float = 10.0
    """Wall-clock seconds from start to kill, jail start-up included."""
    cpu_s: float = 10.0
    """CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL one second later)."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS) and, with a memory cgroup, the run's total."""
    max_processes: int = 64
    """Tasks (processes and threads) alive at once, on top of the jail's own helpers."""
    output_bytes: int = 1 * _MiB
    """stdout + stderr; raised to twice the expected output when that is larger."""
    file_bytes: int = 16 * _MiB
    """Largest file the program may write (RLIMIT_FSIZE)."""
    tmp_bytes: int = 64 * _MiB
    """Size of the private /tmp (and of /dev/shm)."""
    open_files: int = 256
    """RLIMIT_NOFILE."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "output_bytes", "file_bytes", "tmp_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {getattr(self, name)}")
        if self.open_files < 16:
            raise ValueError(f"sandbox limit open_files must be at least 16 (Python needs some), got {self.open_files}")


@dataclass(frozen=True)
class CaseResult:
    """The verdict of one test case; for stdin/stdout cases also what the program printed."""

    verdict: Verdict
    detail: str = ""
    seconds: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""


class SandboxUnavailable(PosttrainError, RuntimeError):
    """The jail cannot start on this machine; the message says what to install or enable."""


class Sandbox:
    """Runs programs in a bubblewrap jail (or, with ``unsafe_local=True``, without one).

    Thread-safe: every run is its own process tree and cgroup."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        unsafe_local: bool = False,
        bwrap: str = "bwrap",
        python: str | None = None,
        label: str = "posttrain-sandbox",
    ) -> None:
        self.limits = limits or Limits()
        self.label = label  # appended to the jailed interpreter's argv: `ps` shows which processes are ours
        self.unsafe_local = unsafe_local
        self.bwrap = shutil.which(bwrap) or bwrap
        self.python, self.prefix = _interpreter(python)
        self.cgroups = sandbox_cgroup.detect()
        if self.cgroups is not None:
            atexit.register(self.cgroups.close)
        self.nproc_rlimit = self.cgroups is None and os.geteuid() != 0

    @property
    def runner(self) -> str:
        return "unsafe-local (no jail)" if self.unsafe_local else f"bubblewrap ({self.bwrap})"

    @property
    def containment(self) -> str:
        if self.cgroups is not None:
            return self.cgroups.description
        if self.nproc_rlimit:
            return "RLIMIT_NPROC (no writable pids cgroup)"
        return "pid namespace + wall-time kill only (no writable pids cgroup; RLIMIT_NPROC does not bind root)"

    def check(self) -> None:
        """Run a trivial program in the jail; raise :class:`SandboxUnavailable` with what to do
        when that fails. With ``unsafe_local`` warn loudly instead of jailing."""
        if self.unsafe_local:
            warnings.warn(
                "code sandbox: unsafe_local=True runs model-written programs WITHOUT a jail (only rlimits); "
                "they can read your files and environment and reach the network",
                RuntimeWarning,
                stacklevel=2,
            )
            log.warning("code sandbox: unsafe_local=True — programs run WITHOUT a jail")
        for result in [self.run_io("print(6 * 7)", "", "42"), *self.run_asserts("x = 6 * 7", ["assert x == 42"])]:
            if result.verdict is not Verdict.PASS:
                raise SandboxUnavailable(_unavailable_message(self.runner, result.detail or result.verdict.value))
        message = f"code sandbox: runner {self.runner}; process limit by {self.containment}"
        if self.cgroups is None and not self.nproc_rlimit:
            log.warning("%s — fork bombs are contained only by the pid namespace and the wall-time kill", message)
        else:
            log.info(message)
        if os.geteuid() == 0 and not self.unsafe_local:
            log.warning(
                "code sandbox: the trainer runs as root, so jailed programs are uid 0 on the host (in a user "
                "namespace, without capabilities); prefer a non-root user"
            )

    # ------------------------------------------------------------------------------------- runs

    def run_io(self, source: str, stdin: str, expected: str) -> CaseResult:
        """One stdin/stdout case: pass when the program exits 0 and its stdout equals ``expected``
        up to trailing whitespace on each line and trailing blank lines."""
        marker = f"posttrain-sandbox-started-{secrets.token_hex(8)}"
        payload = {"source": source, "stdin": stdin, "marker": marker, "limits": self._rlimits()}
        cap = max(self.limits.output_bytes, 2 * len(expected.encode()) + 1024)
        run = self._execute("io", payload, cap)
        if isinstance(run, str):
            return CaseResult(Verdict.INFRA_ERROR, run)
        if not run.stderr.startswith(marker.encode() + b"\n"):
            if run.timed_out:
                return CaseResult(Verdict.INFRA_ERROR, "the jail did not start within the wall time", run.wall_s)
            return CaseResult(Verdict.INFRA_ERROR, _tail(run.stderr) or f"exit status {run.exit_code}", run.wall_s)
        stderr = run.stderr[len(marker) + 1 :]
        verdict, detail = self._classify(run, stderr)
        if verdict is None:
            same = _normalise(run.stdout) == _normalise(expected.encode())
            verdict, detail = (Verdict.PASS, "") if same else (Verdict.FAIL, "wrong output")
        return CaseResult(verdict, detail, run.wall_s, run.stdout, stderr)

    def run_asserts(self, source: str, tests: list[str]) -> list[CaseResult]:
        """Assert-style tests (Python code, each run in a fresh namespace that sees the program's
        names), judged by the referee process; one run for all of them."""
        if not tests:
            return []
        nonce = secrets.token_hex(16)
        payload = {
            "source": source,
            "tests": tests,
            "nonce": nonce,
            "limits": self._rlimits(),
            "python": self.python,
            "harness": _HARNESS,
            "max_message": self.limits.output_bytes,
        }
        cap = self.limits.output_bytes + 1024 * len(tests)
        run = self._execute("referee", payload, cap)
        if isinstance(run, str):
            return [CaseResult(Verdict.INFRA_ERROR, run)] * len(tests)
        started, verdicts = _referee_lines(run.stdout, nonce, len(tests))
        if not started:
            reason = "the jail did not start within the wall time" if run.timed_out else _tail(run.stderr)
            return [CaseResult(Verdict.INFRA_ERROR, reason or f"exit status {run.exit_code}", run.wall_s)] * len(tests)
        missing, missing_detail = self._classify(run, b"")
        if missing is None:
            missing, missing_detail = Verdict.CRASH, "the referee stopped before this test"
        results = []
        for found in verdicts:
            if found is None:
                results.append(CaseResult(missing, missing_detail, run.wall_s))
                continue
            verdict, detail = found
            if verdict is Verdict.CRASH and run.oom_killed and "died" in detail:
                verdict = Verdict.MEMORY
            results.append(CaseResult(verdict, detail, run.wall_s))
        return results

    # -------------------------------------------------------------------------------- internals

    def _classify(self, run: Supervised, stderr: bytes) -> tuple[Verdict | None, str]:
        """The verdict a run earns on its own (None: it finished cleanly, look at the output)."""
        if run.timed_out:
            return Verdict.TIMEOUT, f"wall time {self.limits.wall_s:g} s exceeded"
        if run.output_exceeded:
            return Verdict.CRASH, "output limit exceeded"
        code = run.exit_code
        signal_number = run.signal
        if code is not None and code > 128 and not self.unsafe_local:  # bwrap reports 128 + signal
            signal_number, code = code - 128, None
        if signal_number == 24 or (signal_number == 9 and run.cpu_s >= self.limits.cpu_s - 0.05):  # SIGXCPU
            return Verdict.TIMEOUT, f"CPU time {self.limits.cpu_s:g} s exceeded"
        tail = stderr[-4096:]
        if run.oom_killed or (code not in (0, None) and (b"MemoryError" in tail or b"[Errno 12]" in tail)):
            return Verdict.MEMORY, "memory limit exceeded"
        if signal_number is not None:
            return Verdict.CRASH, f"killed by signal {signal_number}"
        if code != 0:
            return Verdict.CRASH, f"exit status {code}: {_tail(stderr)}"
        return None, ""

    def _rlimits(self) -> dict[str, tuple[int, int]]:
        lim = self.limits
        cpu = math.ceil(lim.cpu_s)
        limits = {
            "RLIMIT_CPU": (cpu, cpu + 1),  # SIGXCPU first; SIGKILL a second later if ignored
            "RLIMIT_AS": (lim.memory_mb * _MiB, lim.memory_mb * _MiB),
            "RLIMIT_FSIZE": (lim.file_bytes, lim.file_bytes),
            "RLIMIT_NOFILE": (lim.open_files, lim.open_files),
            "RLIMIT_CORE": (0, 0),
        }
        if self.nproc_rlimit:
            # inside the jail's user namespace the count is of the jail's own tasks (Linux >= 5.14)
            limits["RLIMIT_NPROC"] = (lim.max_processes + _OVERHEAD_TASKS,) * 2
        return limits

    def _execute(self, mode: str, payload: dict, output_cap: int) -> Supervised | str:
        """One supervised run; a string is the reason the runner itself failed (infra_error)."""
        cgroup = None
        workdir = None
        try:
            if self.cgroups is not None:
                tmp_total = 2 * self.limits.tmp_bytes  # tmpfs pages are charged to the cgroup
                memory = self.limits.memory_mb * _MiB + tmp_total + _OVERHEAD_MEMORY
                cgroup = self.cgroups.acquire(self.limits.max_processes + _OVERHEAD_TASKS, memory)
            if self.unsafe_local:
                workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
                argv = [self.python, "-I", "-S", "-c", _HARNESS, mode, self.label]
                env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
            else:
                if not os.access(self.bwrap, os.X_OK):
                    raise FileNotFoundError(f"{self.bwrap} is missing or not executable (install bubblewrap)")
                argv = self._jail_argv(mode)
                env = {"PATH": "/usr/bin:/bin"}  # bwrap's own environ is readable at /proc/1/environ
            return supervise(
                argv,
                marshal.dumps(payload),
                env=env,
                cwd=workdir or "/",
                wall_s=self.limits.wall_s,
                output_cap=output_cap,
                cgroup=cgroup,
            )
        except Exception as error:  # the runner failed, not the program
            return f"{self.runner} failed: {type(error).__name__}: {error}"
        finally:
            if cgroup is not None and self.cgroups is not None:
                self.cgroups.release(cgroup)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def _jail_argv(self, mode: str) -> list[str]:
        tmp = str(self.limits.tmp_bytes)
        argv = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
        argv += ["--cap-drop", "ALL", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
        argv += ["--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        argv += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        if not self.prefix.startswith("/usr/"):
            argv += ["--ro-bind", self.prefix, self.prefix]
        # /proc read-only: the jail's uid may be the host's root (a trainer run as root), and
        # /proc/sys/kernel/core_pattern and friends check only the uid, not a capability
        argv += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
        argv += ["--size", tmp, "--tmpfs", "/tmp", "--size", tmp, "--tmpfs", "/dev/shm"]
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
        return [*argv, self.python, "-I", "-S", "-c", _HARNESS, mode, self.label]


def _interpreter(python: str | None) -> tuple[str, str]:
    """(interpreter, the install prefix to bind). The default is this interpreter's base install
    — never a virtual environment, which lives in the project's working tree."""
    if python is None:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        prefix = os.path.realpath(sys.base_prefix)
        python = os.path.join(prefix, "bin", version)
        if not os.path.exists(python):
            python = os.path.realpath(sys.executable)
    else:
        python = os.path.realpath(python)
        out = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"], capture_output=True)
        prefix = os.path.realpath(out.stdout.decode().strip() or os.path.dirname(os.path.dirname(python)))
    home = os.path.realpath(os.path.expanduser("~"))
    for private in (home, os.path.realpath(os.getcwd())):
        if prefix in ("/", private) or private.startswith(prefix.rstrip("/") + "/"):
            raise SandboxUnavailable(
                f"the interpreter's install prefix {prefix} contains {private}; binding it would show the program "
                "your files. Pass python=... an interpreter installed elsewhere"
            )
    if not python.startswith(prefix.rstrip("/") + "/"):
        raise SandboxUnavailable(f"interpreter {python} is not inside its install prefix {prefix}")
    return python, prefix


def _unavailable_message(runner: str, detail: str) -> str:
    return (
        f"the code sandbox ({runner}) cannot run a trivial program: {detail.strip()[:500]}\n"
        "To fix: install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`), and allow unprivileged "
        "user namespaces (`sysctl kernel.unprivileged_userns_clone=1`; on Ubuntu >= 23.10 also "
        "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; in Docker run with a seccomp profile that "
        "allows clone/unshare of namespaces). Or choose unsafe_local=True explicitly to run without a jail."
    )


def _referee_lines(stdout: bytes, nonce: str, n: int) -> tuple[bool, list[tuple[Verdict, str] | None]]:
    """The referee's nonce-tagged lines → (started, a verdict per test or None when missing).
    Lines without the nonce (anything the program managed to write) are ignored."""
    started = False
    verdicts: list[tuple[Verdict, str] | None] = [None] * n
    for line in stdout.splitlines():
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if type(fields) is not dict or fields.get("nonce") != nonce:
            continue
        if fields.get("event") == "started":
            started = True
        index = fields.get("index")
        if type(index) is int and 0 <= index < n and verdicts[index] is None:
            verdicts[index] = (Verdict(fields["verdict"]), str(fields.get("detail", "")))
    return started, verdicts


def _normalise(output: bytes) -> list[bytes]:
    lines = [line.rstrip() for line in output.replace(b"\r\n", b"\n").split(b"\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tail(stderr: bytes, limit: int = 300) -> str:
    text = stderr.decode("utf-8", "replace").strip()
    return text[-limit:]
