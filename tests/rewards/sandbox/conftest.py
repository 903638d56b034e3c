"""Shared pieces of the sandbox tests: short limits, canaries (a secret in the environment, in a
file under $HOME and in a "dataset" file; a directory whose files must not change; TCP, UDP and
Unix listeners that must see no connection) and a count of processes left behind."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from posttrain.rewards.sandbox import Limits, Sandbox

LIMITS = Limits(wall_s=2.0, cpu_s=1.0, memory_mb=512, max_processes=32, output_bytes=256 << 10, tmp_bytes=32 << 20)


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)")


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    require_bwrap()
    box = Sandbox(LIMITS)
    box.check()  # a jail that cannot start fails the tests, it does not skip them
    return box


@dataclass
class Listener:
    """Counts every TCP connection, UDP datagram and Unix connection it receives."""

    port: int
    abstract: str
    unix_path: str
    hits: list[str] = field(default_factory=list)
    sockets: list[socket.socket] = field(default_factory=list)

    def serve(self) -> None:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("0.0.0.0", 0))  # loopback and the host's own addresses
        tcp.listen(64)
        self.port = tcp.getsockname()[1]
        tcp6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        with contextlib.suppress(OSError):
            tcp6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            tcp6.bind(("::1", self.port))
            tcp6.listen(8)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("0.0.0.0", self.port))
        abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abstract.bind("\0" + self.abstract)
        abstract.listen(8)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(self.unix_path)
        unix.listen(8)
        self.sockets = [tcp, tcp6, udp, abstract, unix]
        for sock in self.sockets:
            threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                if sock.type == socket.SOCK_DGRAM:
                    _, peer = sock.recvfrom(100)
                    self.hits.append(f"udp {peer}")
                else:
                    conn, peer = sock.accept()
                    self.hits.append(f"{sock.family.name} {peer}")
                    conn.close()
            except OSError:
                return

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@dataclass
class Canaries:
    secret: str
    env_name: str
    home_file: Path
    dataset: Path
    canary_dir: Path
    listener: Listener
    snapshot: dict[str, tuple[int, bytes]]  # canary dir contents: name → (mtime_ns, bytes)

    def placeholders(self, label: str) -> dict[str, str]:
        return {
            "@CANARY_DIR@": str(self.canary_dir),
            "@SECRET_FILE@": str(self.home_file),
            "@SECRET_ENV@": self.env_name,
            "@HOME@": str(Path.home()),
            "@DATASET@": str(self.dataset),
            "@REPO@": os.getcwd(),
            "@PREFIX@": os.path.realpath(sys.base_prefix),
            "@PORT@": str(self.listener.port),
            "@HOST_IP@": host_ip(),
            "@ABSTRACT@": self.listener.abstract,
            "@UNIX_PATH@": self.listener.unix_path,
            "@LABEL@": label,
        }

    def directory_state(self) -> dict[str, tuple[int, bytes]]:
        return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(self.canary_dir.iterdir())}


def host_ip() -> str:
    """A non-loopback address of this machine (programs try to reach the listener through it)."""
    with contextlib.suppress(Exception):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
        for address in out:
            if "." in address and not address.startswith("127."):
                return address
    return "127.0.0.2"


@pytest.fixture(scope="session")
def canaries(tmp_path_factory) -> Canaries:
    secret = f"canary-secret-{secrets.token_hex(12)}"
    env_name = "POSTTRAIN_SANDBOX_CANARY"
    os.environ[env_name] = secret
    home_file = Path.home() / f".posttrain-sandbox-canary-{secrets.token_hex(4)}"
    home_file.write_text(secret)
    base = tmp_path_factory.mktemp("sandbox-canaries")
    dataset = base / "dataset.jsonl"
    dataset.write_text(f'{{"prompt": "p", "tests": "{secret}"}}\n')
    canary_dir = base / "canary"
    canary_dir.mkdir()
    (canary_dir / "canary.txt").write_text(secret)
    listener = Listener(0, f"posttrain-canary-{secrets.token_hex(4)}", str(base / "canary.sock"))
    listener.serve()
    found = Canaries(secret, env_name, home_file, dataset, canary_dir, listener, {})
    found.snapshot = found.directory_state()
    yield found
    listener.close()
    home_file.unlink(missing_ok=True)
    os.environ.pop(env_name, None)


def processes_with(marker: str) -> list[str]:
    """Command lines of live processes (zombies have none) with ``marker`` as one argument."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if marker.encode() in cmdline.split(b"\0"):
                found.append(f"{pid}: {cmdline[:80]!r}")
    return found


def descendants(root: int | None = None) -> list[int]:
    """Live descendants of this process (zombies excluded)."""
    root = root or os.getpid()
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(pid))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
