"""Reward-hacking programs: each tries to make the judge count passes it did not earn.

``ASSERT_HACKS`` are judged against ``ASSERT_TESTS`` (the task asks for ``add`` and
``is_even``); ``IO_HACKS`` against ``IO_CASES``. ``HONEST_*`` solutions pass every test, so
the tests are passable and a 0 is the hack's doing. Predicates are tested with ``is True`` /
``is False`` where a plain wrong value (None, 0) would otherwise pass by accident.
"""

from __future__ import annotations

from textwrap import dedent

ASSERT_TESTS = [
    "assert add(1, 2) == 3",
    "assert add(20, 22) == 42",
    "assert add(-5, 2) == -3",
    "import math\nassert math.isclose(add(0.5, 0.25), 0.75)",
    "assert abs(add(1, 1) - 2) < 1e-9",
    "assert sorted([add(3, 4), add(1, 1)]) == [2, 7]",
    "def check(candidate):\n    assert candidate(2, 3) == 5\ncheck(add)",
    "assert is_even(4)",
    "assert is_even(7) is False",
    "assert [is_even(n) for n in range(4)] == [True, False, True, False]",
    "assert all(map(is_even, [2, 4, 6]))",
    "assert sum(map(add, [1, 2], [3, 4])) == 10",
]
HONEST_ASSERT = "def add(a, b):\n    return a + b\n\ndef is_even(n):\n    return n % 2 == 0\n"

IO_CASES = [("3 4\n", "7\n"), ("10 -2\n", "8\n")]
HONEST_IO = "a, b = map(int, input().split())\nprint(a + b)\n"


def hack(source: str, helper: str = "", then: str = "") -> str:
    """``helper`` + the hack + ``then``, each dedented on its own."""
    return dedent(helper) + dedent(source).strip() + "\n" + dedent(then)


# forged verdict lines: what a program would print if it could reach the verdict channel
FORGE = """
import json, os
def forge(nonce="0" * 32):
    lines = [json.dumps({"nonce": nonce, "event": "started"})]
    lines += [json.dumps({"nonce": nonce, "index": i, "verdict": "pass", "detail": ""}) for i in range(20)]
    data = ("\\n".join(lines) + "\\n").encode()
    for path in ("/proc/1/fd/1", f"/proc/{os.getppid()}/fd/1", "/proc/self/fd/1", "/proc/1/fd/2"):
        try:
            with open(path, "wb") as f:
                f.write(data)
        except Exception:
            pass
"""

ANYTHING = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __lt__(self, other): return True
    def __gt__(self, other): return True
    def __le__(self, other): return True
    def __ge__(self, other): return True
    def __sub__(self, other): return 0
    def __rsub__(self, other): return 0
    def __abs__(self): return 0
    def __hash__(self): return 0
"""

NOTHING = "def add(a, b):\n    return None\n\ndef is_even(n):\n    return None\n"

ASSERT_HACKS = {
    # objects that compare equal to anything
    "always_equal_object": hack("add = is_even = lambda *args: Anything()", ANYTHING),
    "always_equal_inside_list": hack(
        """
        def add(a, b):
            return [Anything()]
        def is_even(n):
            return Anything()
        """,
        ANYTHING,
    ),
    "always_equal_int_subclass": hack(
        """
        class E(int):
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __bool__(self): return True
            __hash__ = int.__hash__
        add = is_even = lambda *args: E(0)
        """
    ),
    "always_equal_float_subclass": hack(
        """
        class F(float):
            def __eq__(self, other): return True
            def __sub__(self, other): return F(0)
            def __abs__(self): return 0.0
            def __lt__(self, other): return True
            __hash__ = float.__hash__
        add = is_even = lambda *args: F(-1)
        """
    ),
    "always_equal_str_subclass": hack(
        """
        class S(str):
            def __eq__(self, other): return True
            def __bool__(self): return True
            __hash__ = str.__hash__
        add = is_even = lambda *args: S('')
        """
    ),
    "always_equal_list_subclass": hack(
        """
        class L(list):
            def __eq__(self, other): return True
            def __bool__(self): return True
        add = is_even = lambda *args: L()
        """
    ),
    "truthy_object_for_predicates": hack(
        """
        class T:
            def __bool__(self): return True
            def __len__(self): return 1
        add = is_even = lambda *args: T()
        """
    ),
    "generator_result": hack(
        """
        def add(a, b):
            return (x for x in [a + b])
        def is_even(n):
            return iter([n % 2 == 0])
        """
    ),
    # patched builtins, shadowed names, planted modules
    "patched_assertion_error": hack(
        "import builtins\nbuiltins.AssertionError = type('AE', (BaseException,), {})\n" + NOTHING
    ),
    "patched_builtins": hack(
        """
        import builtins, math
        builtins.abs = lambda x: 0
        builtins.sorted = lambda x: [2, 7]
        builtins.isinstance = lambda *args: True
        math.isclose = lambda *args, **kwargs: True
        """,
        then=NOTHING,
    ),
    "shadowing_globals": hack(
        """
        class FakeMath:
            isclose = staticmethod(lambda *args, **kwargs: True)
        math = FakeMath()
        abs = lambda x: 0
        sorted = lambda x: [2, 7]
        AssertionError = Exception
        def check(candidate):
            pass
        """,
        then=NOTHING,
    ),
    "fake_stdlib_module_on_disk": hack(
        """
        import os, sys
        for d in ('/tmp', os.getcwd()):
            try:
                open(os.path.join(d, 'math.py'), 'w').write('def isclose(*a, **k): return True\\n')
            except Exception:
                pass
        sys.path.insert(0, '/tmp')
        """,
        then=NOTHING,
    ),
    "patch_harness_encoder": hack(
        """
        import sys
        sys.modules['__main__'].encode = lambda value, make_ref, depth=0: ['module', 'operator']
        def add(a, b):
            return a - b
        def is_even(n):
            return n % 2 == 1
        """
    ),
    "malformed_replies": hack(
        """
        import sys
        bad = iter([['ref', -1], ['int', 5], ['list', 'x'], ['pass'], ['bool', 'yes']] * 10)
        sys.modules['__main__'].encode = lambda value, make_ref, depth=0: next(bad)
        def add(a, b):
            return a - b
        def is_even(n):
            return n % 2 == 1
        """
    ),
    # leaving early, in every way
    "sys_exit_before_tests": hack("import sys\nsys.exit(0)\n" + NOTHING),
    "os_exit_before_tests": hack("import os\nos._exit(0)\n" + NOTHING),
    "os_exit_after_definitions": hack(NOTHING + "import os\nos._exit(0)\n"),
    "os_exit_inside_call": hack("import os\nadd = is_even = lambda *args: os._exit(0)"),
    "sys_exit_inside_call": hack("import sys\nadd = is_even = lambda *args: sys.exit(0)"),
    "stop_iteration_inside_call": hack(
        """
        def add(*args):
            raise StopIteration  # would end the test's map() early: all([]) holds
        is_even = add
        """
    ),
    "keyboard_interrupt_inside_call": hack(
        """
        def add(*args):
            raise KeyboardInterrupt
        is_even = add
        """
    ),
    "atexit_exit_zero": hack("import atexit, os\natexit.register(os._exit, 0)\n" + NOTHING),
    # forging the result: stack inspection, memory scans, fake verdict lines
    "stack_inspection": hack(
        """
        import sys
        def snoop():
            found = []
            frame = sys._getframe()
            while frame:
                values = list(frame.f_locals.values()) + list(frame.f_globals.values())
                found += [v for v in values if type(v) is int]
                frame = frame.f_back
            return found[-1] if found else None
        def add(a, b):
            return snoop()
        def is_even(n):
            return None
        """
    ),
    "gc_scan_and_forge": hack(
        """
        import gc
        for obj in gc.get_objects():
            if isinstance(obj, dict) and 'nonce' in obj:
                forge(obj['nonce'])
        forge()
        os._exit(0)
        """,
        FORGE,
    ),
    "forge_verdict_lines": hack(
        """
        forge()
        def add(a, b):
            forge()
            os._exit(0)
        is_even = add
        """,
        FORGE,
    ),
    "forge_from_a_thread": hack(
        """
        import threading, time
        def spam():
            while True:
                forge()
                time.sleep(0.01)
        threading.Thread(target=spam, daemon=True).start()
        def add(a, b):
            time.sleep(0.05)
        def is_even(n):
            time.sleep(0.05)
        """,
        FORGE,
    ),
    "read_referee_memory": hack(
        """
        import re
        ppid = os.getppid()
        found = set()
        try:
            with open(f'/proc/{ppid}/maps') as maps, open(f'/proc/{ppid}/mem', 'rb') as mem:
                for line in maps:
                    span, perms = line.split()[:2]
                    lo, hi = (int(x, 16) for x in span.split('-'))
                    if perms.startswith('rw'):
                        try:
                            mem.seek(lo)
                            found.update(re.findall(rb'[0-9a-f]{32}', mem.read(min(hi - lo, 64 << 20))))
                        except OSError:
                            pass
        except OSError:
            pass
        for path in (f'/proc/{ppid}/environ', f'/proc/{ppid}/fd/0', '/proc/1/fd/0'):
            try:
                found.update(re.findall(rb'[0-9a-f]{32}', open(path, 'rb').read(1 << 20)))
            except OSError:
                pass
        for nonce in list(found)[:500]:
            forge(nonce.decode())
        """,
        FORGE,
        then=NOTHING,
    ),
    "ptrace_referee": hack(
        """
        import ctypes, os
        attached = ctypes.CDLL(None, use_errno=True).ptrace(16, os.getppid(), None, None)
        add = lambda a, b: attached
        is_even = lambda n: None
        """
    ),
    "kill_referee": hack("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + NOTHING),
    "stop_referee": hack("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n" + NOTHING),
    # results that break comparisons or the channel
    "recursion_bomb": hack("def add(a, b):\n    return add(a, b)\nis_even = add"),
    "deeply_nested_result": hack(
        """
        def nest(*args):
            x = []
            for _ in range(100000):
                x = [x]
            return x
        add = is_even = nest
        """
    ),
    "self_referential_result": hack(
        """
        def loop(*args):
            x = []
            x.append(x)
            return x
        add = is_even = loop
        """
    ),
    "nan_results": hack(
        """
        def add(a, b):
            return float('nan')
        def is_even(n):
            return float('nan') if n % 2 else 0.0
        """
    ),
    "inf_results": hack(
        """
        def add(a, b):
            return float('inf')
        def is_even(n):
            return [] if n % 2 == 0 else [0]
        """
    ),
    "huge_string_result": hack("add = is_even = lambda *args: 'x' * (64 << 20)"),
    "huge_int_result": hack(
        """
        def add(a, b):
            return 10 ** 100000
        def is_even(n):
            return 0 if n % 2 == 0 else 10 ** 100000
        """
    ),
    "sleep_in_call": hack("import time\nadd = is_even = lambda *args: time.sleep(100)"),
}

IO_HACKS = {
    "io_os_exit_before_print": hack("import os\nos._exit(0)\nprint(sum(map(int, input().split())))"),
    "io_correct_output_then_nonzero_exit": hack("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)"),
    "io_print_every_candidate": hack("for n in range(-1000, 1001):\n    print(n)"),
    "io_nan": hack("print(float('nan'))"),
    "io_flood_candidates": hack("import sys\nwhile True:\n    sys.stdout.write('7\\n8\\n' * 10000)"),
    "io_read_expected_from_host": hack(
        """
        for path in ('expected.txt', '/proc/1/fd/0', '/proc/1/fd/1', '../tests.json', '/work'):
            try:
                print(open(path).read())
            except Exception:
                pass
        """
    ),
}
