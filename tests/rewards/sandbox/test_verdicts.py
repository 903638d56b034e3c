"""What each verdict means, case by case, and how assert-style tests see the program."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap

import pytest

from posttrain.rewards.sandbox import Limits, Sandbox, Verdict, _referee_lines

from .conftest import LIMITS

SUM = "import sys\nprint(sum(map(int, sys.stdin.read().split())))"


@pytest.mark.parametrize(
    ("source", "expected", "verdict"),
    [
        (SUM, "6", Verdict.PASS),
        ("print('6   ')\nprint()\nprint()", "6\n", Verdict.PASS),  # trailing spaces and blank lines
        ("import sys\nsys.stdout.write('6\\r\\n')", "6", Verdict.PASS),
        ("print(' 6')", "6", Verdict.FAIL),  # leading whitespace counts
        ("print(7)", "6", Verdict.FAIL),
        ("print(6)\nraise SystemExit(2)", "6", Verdict.CRASH),  # right output, non-zero exit
        ("print(6)\n1 / 0", "6", Verdict.CRASH),
        ("def broken(:", "6", Verdict.CRASH),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "6", Verdict.CRASH),
        ("x = bytearray(1 << 40)", "6", Verdict.MEMORY),
        ("import time\ntime.sleep(60)", "6", Verdict.TIMEOUT),
        ("while True: pass", "6", Verdict.TIMEOUT),
        ("import sys\nwhile True: sys.stdout.write('6' * 4096)", "6", Verdict.CRASH),
    ],
)
def test_stdin_stdout_verdicts(sandbox, source, expected, verdict):
    result = sandbox.run_io(source, "1 2 3", expected)
    assert result.verdict is verdict, result
    assert result.seconds <= LIMITS.wall_s + 1.0


def test_cpu_limit_is_a_timeout_before_the_wall_time(sandbox):
    # wall time far above the CPU limit: on a loaded 2-core machine 1 s of CPU took over 2 s of wall
    # time (the suite's own workers), and the wall limit fired first
    roomy = Sandbox(dataclasses.replace(LIMITS, wall_s=30.0))
    result = roomy.run_io("while True: pass", "", "")
    assert result.verdict is Verdict.TIMEOUT and "CPU" in result.detail, result
    assert result.seconds < 30.0


def test_output_cap_kill_is_a_crash_but_a_large_expected_output_raises_the_cap(sandbox):
    big = "x" * (LIMITS.output_bytes * 2)
    assert sandbox.run_io(f"print('{big}')", "", "y").verdict is Verdict.CRASH
    assert sandbox.run_io(f"print('{big}')", "", big).verdict is Verdict.PASS


def test_stdin_is_a_real_file_descriptor_and_may_be_large(sandbox):
    numbers = " ".join(["1"] * 300_000)
    source = "import os\ndata = b''\nwhile chunk := os.read(0, 65536): data += chunk\nprint(len(data.split()))"
    assert sandbox.run_io(source, numbers, "300000").verdict is Verdict.PASS


def test_assert_tests_get_one_verdict_each(sandbox):
    program = textwrap.dedent(
        """
        import math
        LIMIT = 10
        def area(r):
            return math.pi * r * r
        def first(xs):
            return xs[0]
        class Solution:
            def two_sum(self, nums, target):
                seen = {}
                for i, n in enumerate(nums):
                    if target - n in seen:
                        return [seen[target - n], i]
                    seen[n] = i
        def count_up(n):
            yield from range(n)
        """
    )
    tests = [
        "assert abs(area(1) - 3.14159) < 1e-4",
        "assert math.isclose(area(2), 4 * math.pi)",  # `math` is the program's import
        "assert LIMIT == 10",
        "assert Solution().two_sum([2, 7, 11], 9) == [0, 1]",
        "assert list(count_up(3)) == [0, 1, 2]",
        "try:\n    first([])\nexcept IndexError:\n    pass\nelse:\n    raise AssertionError('no IndexError')",
        "assert first([5]) == 6",
        "assert first([]) == 0",  # the program raises: a crash, not a fail
        "assert missing(1) == 1",  # the program does not define it
        "x = 1",
        "assert 'x' not in globals()",  # every test starts from a fresh namespace
        "assert first(lambda: 0) == 0",  # test code cannot hand its own functions to the program
    ]
    verdicts = [r.verdict.value for r in sandbox.run_asserts(program, tests)]
    assert verdicts == ["pass"] * 6 + ["fail", "crash", "fail", "pass", "pass", "fail"]


def test_memory_error_in_a_call_is_memory(sandbox):
    program = "def grab(n):\n    return bytearray(n)"
    results = sandbox.run_asserts(program, ["assert len(grab(1 << 40)) > 0", "assert grab(3) == bytearray(3)"])
    assert [r.verdict for r in results] == [Verdict.MEMORY, Verdict.FAIL]  # bytearray is not a plain value


def test_a_timeout_marks_the_tests_that_did_not_finish(sandbox):
    program = "import time\ndef f(x):\n    if x:\n        time.sleep(60)\n    return x"
    results = sandbox.run_asserts(program, ["assert f(0) == 0", "assert f(1) == 1", "assert f(0) == 0"])
    assert [r.verdict for r in results] == [Verdict.PASS, Verdict.TIMEOUT, Verdict.TIMEOUT]


def test_referee_lines_without_the_nonce_are_ignored():
    nonce = "a" * 32
    lines = [
        {"nonce": "b" * 32, "event": "started"},
        {"nonce": "b" * 32, "index": 0, "verdict": "pass"},
        {"nonce": nonce, "index": 1, "verdict": "fail", "detail": "x"},
        {"nonce": nonce, "index": 1, "verdict": "pass"},  # a second line for a test does not count
        {"nonce": nonce, "index": 7, "verdict": "pass"},
    ]
    stdout = b"garbage\n" + b"\n".join(json.dumps(line).encode() for line in lines) + b"\n{not json"
    started, verdicts = _referee_lines(stdout, nonce, 2)
    assert not started and verdicts == [None, (Verdict.FAIL, "x")]


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wall_s must be positive"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="open_files"):
        Limits(open_files=3)


def test_the_jail_sees_no_virtual_environment_and_no_working_directory(sandbox):
    here = os.getcwd()
    source = f"import os, sys\nprint(sys.prefix, os.getcwd(), os.path.exists({here!r}), os.path.exists({sys.prefix!r}))"
    result = sandbox.run_io(source, "", "")
    prefix, cwd, repo, venv = result.stdout.decode().split()
    assert ".venv" not in prefix and cwd == "/tmp" and repo == venv == "False"
    assert Sandbox(LIMITS).runner.startswith("bubblewrap")
