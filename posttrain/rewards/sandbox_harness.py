"""The code that runs *inside* the jail around a program under test (stdlib only).

The trainer never imports this module to run it: ``sandbox.py`` passes its text to
``python -I -S -c <this file> MODE`` inside the jail, and the payload (program, input, tests,
limits) arrives on stdin, never on the command line (``/proc/*/cmdline`` is world-readable).
The payload is ``marshal``-ed (format 4, the same for these plain types since Python 3.4):
unlike ``json`` it costs no import, and imports are most of a short run's start-up.

Modes (``sys.argv[1]``):

``io``
    One stdin/stdout case. Sets the limits, prints a start marker on stderr, then runs the
    program in this process with the case's input on fd 0. The verdict is made outside from
    the exit status and stdout; nothing here is trusted.

``referee``
    Assert-style tests. Python has no boundary inside one process: a program can walk the stack,
    ``gc.get_objects()`` or patch builtins, so a harness that runs asserts in the program's own
    process can be forged (read the expected values or the "all passed" token from memory, print
    it, ``os._exit(0)``). The referee therefore never runs program code. It makes itself
    non-dumpable (no ptrace, no ``/proc/<pid>/mem``, no ``/proc/<pid>/fd`` for the program),
    starts a fresh interpreter for the program (the ``worker``), and runs each test *here*,
    with every name the program defined replaced by a proxy that asks the worker to call it.
    Values come back as plain data (ints, strs, lists, ...) rebuilt by the referee, so an object
    that "equals anything" cannot cross; anything else stays an opaque handle that refuses to be
    compared or used as a truth value. Verdict lines carry a per-run nonce that only the referee
    holds.

``worker``
    The untrusted side: runs the program's source, then answers the referee's calls.

Known limit of the proxies: arguments cross by value (a test that relies on the program
mutating a list it passed in sees no change), and test code cannot pass its own functions or
objects to the program.
"""

from __future__ import annotations

import builtins
import marshal
import os
import sys

MAX_DEPTH = 200  # nesting of a value crossing between referee and worker


def read_fd(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def apply_limits(limits: dict) -> None:
    """The parent computed the values; a hard limit, once lowered, cannot be raised without
    CAP_SYS_RESOURCE, which the jail drops."""
    import resource

    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


# ---------------------------------------------------------------------------------------------
# io mode


def run_io(payload: dict) -> None:
    fd = os.memfd_create("stdin")  # a real fd 0: programs may use sys.stdin.buffer or os.read(0)
    write_fd(fd, payload["stdin"].encode("utf-8", "surrogateescape"))
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    apply_limits(payload["limits"])
    write_fd(2, payload["marker"].encode() + b"\n")
    source = payload["source"]
    del payload
    sys.argv = ["solution.py"]
    # an uncaught exception prints its traceback and exits 1, exactly as `python solution.py`
    exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})


# ---------------------------------------------------------------------------------------------
# values crossing between referee and worker: tagged JSON, rebuilt from scratch on arrival


def encode(value, make_ref, depth: int = 0):
    kind = type(value)  # exact types: a subclass of int may override __eq__
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", hex(value)]  # hex is exempt from the 4300-digit str limit
    if kind is float:
        return ["float", value.hex()]
    if kind is complex:
        return ["complex", value.real.hex(), value.imag.hex()]
    if kind is str:
        return ["str", value]
    if kind is bytes:
        return ["bytes", value.hex()]
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [encode(item, make_ref, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode(k, make_ref, depth + 1), encode(v, make_ref, depth + 1)] for k, v in value.items()]]
    return ["ref", make_ref(value)]


_SCALARS = {
    "int": lambda v: int(v, 16),
    "float": float.fromhex,
    "str": str,
    "bytes": bytes.fromhex,
    "bool": bool,
}


def decode(item, resolve_ref, depth: int = 0):
    """Strict: anything malformed raises; only plain values and resolved refs come out."""
    if type(item) is not list or not item or type(item[0]) is not str or depth > MAX_DEPTH:
        raise ValueError("malformed value")
    tag, args = item[0], item[1:]
    if tag == "none" and not args:
        return None
    if tag in _SCALARS and len(args) == 1:
        expected = bool if tag == "bool" else str
        if type(args[0]) is not expected:
            raise ValueError("malformed value")
        return _SCALARS[tag](args[0])
    if tag == "complex" and len(args) == 2 and all(type(a) is str for a in args):
        return complex(float.fromhex(args[0]), float.fromhex(args[1]))
    if tag in ("list", "tuple", "set", "frozenset") and len(args) == 1 and type(args[0]) is list:
        items = [decode(x, resolve_ref, depth + 1) for x in args[0]]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and len(args) == 1 and type(args[0]) is list:
        pairs = args[0]
        if not all(type(p) is list and len(p) == 2 for p in pairs):
            raise ValueError("malformed value")
        return {decode(k, resolve_ref, depth + 1): decode(v, resolve_ref, depth + 1) for k, v in pairs}
    if tag == "ref" and len(args) == 1 and type(args[0]) is int:
        return resolve_ref(args[0])
    if tag == "module" and len(args) == 1 and type(args[0]) is str:
        return resolve_ref(("module", args[0]))
    raise ValueError("malformed value")


# ---------------------------------------------------------------------------------------------
# worker: untrusted, runs the program


def run_worker() -> None:
    import json

    rpc_in = os.fdopen(os.dup(0), "rb")
    rpc_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the program's prints and reads must not touch the channel
    os.dup2(null, 1)
    handles: list = []

    def make_ref(value) -> int:
        handles.append(value)
        return len(handles) - 1

    def send(message: dict) -> None:
        rpc_out.write(json.dumps(message).encode() + b"\n")
        rpc_out.flush()

    def reply(fn) -> dict:
        try:
            return {"ok": encode(fn(), make_ref)}
        except BaseException as error:  # SystemExit and KeyboardInterrupt included
            return {"raise": type(error).__name__, "message": str(error)[:300]}

    request = json.loads(rpc_in.readline())
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(request["source"], "solution.py", "exec"), namespace)
    except BaseException as error:
        send({"loaded": False, "raise": type(error).__name__, "message": str(error)[:300]})
        return
    exports = {}
    for name in request["names"]:
        if name in namespace:
            value = namespace[name]
            is_module = type(value) is type(os)
            exports[name] = {"ok": ["module", value.__name__]} if is_module else reply(lambda v=value: v)
    send({"loaded": True, "names": exports})
    for line in rpc_in:
        call = json.loads(line)
        send(reply(lambda call=call: perform(call, handles)))


def perform(call: dict, handles: list):
    """One request of the referee, run on the program's objects."""
    args = [decode(a, handles.__getitem__) for a in call.get("args", [])]
    kwargs = {k: decode(v, handles.__getitem__) for k, v in call.get("kwargs", {}).items()}
    target, op = handles[call["ref"]], call["op"]
    if op == "call":
        return target(*args, **kwargs)
    if op == "getattr":
        return getattr(target, call["name"])
    if op == "iter":
        return iter(target)
    if op == "next":
        return next(target)
    if op == "len":
        return len(target)
    if op == "getitem":
        return target[args[0]]
    raise ValueError(f"unknown request {op!r}")


# ---------------------------------------------------------------------------------------------
# referee: trusted, never runs program code


class Broken(BaseException):
    """The worker died or broke the protocol. A BaseException, so a test's ``except Exception``
    cannot swallow it; the link also remembers it."""


class Link:
    def __init__(self, python: str, harness: str, max_message: int) -> None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        # posix_spawn execs a fresh interpreter: nothing of this process's memory (tests, nonce)
        # is copied into it, and only fds 0-2 are inherited (os.pipe fds are close-on-exec)
        self.pid = os.posix_spawn(
            python,
            [python, "-I", "-S", "-c", harness, "worker", *sys.argv[2:3]],
            {},
            file_actions=[
                (os.POSIX_SPAWN_DUP2, requests_r, 0),
                (os.POSIX_SPAWN_DUP2, replies_w, 1),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
        )
        os.close(requests_r)
        os.close(replies_w)
        self.requests = os.fdopen(requests_w, "wb")
        self.replies = os.fdopen(replies_r, "rb")
        self.max_message = max_message
        self.broken: str | None = None

    def send(self, message: dict) -> None:
        import json  # here, not at the top: the io mode never pays for it

        try:
            self.requests.write(json.dumps(message).encode() + b"\n")
            self.requests.flush()
        except OSError:
            self.fail("the program's process died")

    def receive(self) -> dict:
        import json

        if self.broken:
            raise Broken(self.broken)
        line = self.replies.readline(self.max_message + 1)
        if not line.endswith(b"\n"):
            self.fail("the program's process died" if len(line) <= self.max_message else "reply too large")
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            self.fail("malformed reply")
        if type(message) is not dict:
            self.fail("malformed reply")
        return message

    def fail(self, reason: str):
        self.broken = self.broken or reason
        raise Broken(self.broken)

    def value(self, reply: dict, export: bool = False, op: str = "call"):
        """A reply → a plain value or a proxy; an exception of the program is re-raised.
        Only an exported name may stand for a module (the genuine one is imported here);
        a call never returns one, else a truthy module could answer ``assert is_prime(7)``.
        StopIteration is re-raised only for ``next``: from a call it would silently end the
        test's ``map``/``filter`` loop, and ``all(map(is_prime, primes))`` would hold."""
        if type(reply) is not dict:
            self.fail("malformed reply")
        ok = reply.get("ok")
        if export and type(ok) is list and len(ok) == 2 and ok[0] == "module" and type(ok[1]) is str:
            try:
                return import_module(ok[1])
            except Exception:
                self.fail("malformed reply")
        if "ok" in reply:
            try:
                return decode(reply["ok"], self.resolve)
            except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
                self.fail("malformed reply")
        name, message = str(reply.get("raise")), str(reply.get("message", ""))[:300]
        cls = getattr(builtins, name, None)
        builtin_error = isinstance(cls, type) and issubclass(cls, Exception)
        ends_loops = builtin_error and issubclass(cls, (StopIteration, StopAsyncIteration)) and op != "next"
        if not builtin_error or ends_loops:
            cls = ProgramError
        try:
            error = cls(message)
        except Exception:
            error = ProgramError(f"{name}: {message}")
        error.raised_by_program = True
        raise error

    def resolve(self, ref):
        if type(ref) is not int:  # ("module", name) inside a value
            raise ValueError("a module cannot be a value")
        return Remote(self, ref)

    def request(self, op: str, ref: int, *args, **fields):
        self.send({"op": op, "ref": ref, "args": [encode(a, _ref_of) for a in args], **fields})
        return self.value(self.receive(), op=op)


class ProgramError(Exception):
    """An exception of the program that is not a built-in Exception (SystemExit included)."""


def _ref_of(value) -> int:
    if type(value) is Remote:
        return object.__getattribute__(value, "ref")
    raise TypeError(f"a test cannot pass a {type(value).__name__} to the program (only plain values cross)")


def import_module(name: str):
    if name not in getattr(sys, "stdlib_module_names", ()) or name in ("this", "antigravity"):
        raise ValueError("not a standard-library module")
    import importlib

    return importlib.import_module(name)


class Remote:
    """A handle on an object living in the worker. Calls, attributes, iteration, len and
    indexing are forwarded; comparison, hashing and truth are refused, because their answer
    would come from the program."""

    __slots__ = ("link", "ref")

    def __init__(self, link: Link, ref: int) -> None:
        object.__setattr__(self, "link", link)
        object.__setattr__(self, "ref", ref)

    def _ask(self, op: str, *args, **fields):
        return object.__getattribute__(self, "link").request(op, object.__getattribute__(self, "ref"), *args, **fields)

    def __call__(self, *args, **kwargs):
        link = object.__getattribute__(self, "link")
        ref = object.__getattribute__(self, "ref")
        link.send(
            {
                "op": "call",
                "ref": ref,
                "args": [encode(a, _ref_of) for a in args],
                "kwargs": {str(k): encode(v, _ref_of) for k, v in kwargs.items()},
            }
        )
        return link.value(link.receive())

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __len__(self) -> int:
        n = self._ask("len")
        if type(n) is not int:
            raise TypeError("len() of an object of the program is not an int")
        return n

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def _refuse(self, *_):
        raise TypeError("an object of the program cannot be compared or tested for truth; return plain values")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _refuse
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<object #{object.__getattribute__(self, 'ref')} of the program>"


def referee_verdict(error: BaseException | None, link: Link) -> tuple[str, str]:
    if link.broken:
        return "crash", link.broken
    if error is None:
        return "pass", ""
    detail = f"{type(error).__name__}: {error}"[:300]
    if getattr(error, "raised_by_program", False):
        return ("memory" if isinstance(error, MemoryError) else "crash"), detail
    if isinstance(error, MemoryError):
        return "memory", detail
    return "fail", detail  # AssertionError, or the test tripped over a wrong or missing result


def run_referee(payload: dict) -> None:
    import json

    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # the tests' own prints must not mix with the verdict lines
    apply_limits(payload["limits"])
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
    nonce = payload["nonce"]

    def emit(**fields) -> None:
        write_fd(out, json.dumps({"nonce": nonce, **fields}).encode() + b"\n")

    tests = [compile(code, f"<test {i}>", "exec") for i, code in enumerate(payload["tests"])]
    wanted = sorted({name for code in tests for name in _names(code)} - set(dir(builtins)))
    emit(event="started")
    link = Link(payload["python"], payload["harness"], payload["max_message"])
    link.send({"source": payload["source"], "names": wanted})
    del payload
    exports = {}
    try:
        loaded = link.receive()
        if loaded.get("loaded") is not True or type(loaded.get("names")) is not dict:
            problem = f"{loaded.get('raise', 'error')}: {loaded.get('message', '')}"[:300]
            kind = "memory" if loaded.get("raise") == "MemoryError" else "crash"
            for i in range(len(tests)):
                emit(index=i, verdict=kind, detail=f"the program stopped before the tests: {problem}")
            return
        exports = loaded["names"]
    except Broken:
        pass
    for i, code in enumerate(tests):
        namespace = {"__name__": "__test__", "__builtins__": builtins}
        error = None
        try:
            for name in wanted:
                if name in exports:
                    namespace[name] = link.value(exports[name], export=True)
            exec(code, namespace)
        except BaseException as caught:
            error = caught
        verdict, detail = referee_verdict(error, link)
        emit(index=i, verdict=verdict, detail=detail)
    emit(event="done")


def _names(code) -> set:
    """Every global or attribute name a test's code (and its nested functions) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def main() -> None:
    mode = sys.argv[1]
    if mode == "worker":
        run_worker()
        return
    payload = marshal.loads(read_fd(0))
    if mode == "io":
        run_io(payload)
    elif mode == "referee":
        run_referee(payload)
        os._exit(0)  # do not wait on the worker; the jail's end kills it
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
