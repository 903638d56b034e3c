#!/usr/bin/env python
"""Code-reward throughput and the jail's start-up overhead, on this machine.

Start-up: the median wall time of one trivial program (``print(1)``) run five ways — a plain
``python -I -S`` subprocess; the sandbox harness without the jail (``unsafe_local``) and
without a cgroup; the harness in the bubblewrap jail without a cgroup; the jail with its
per-run pids+memory cgroup (the real set-up); and an assert-style run (referee + worker, two
interpreters) in the real set-up. The sides take turns ``--repeats`` times, so a busy
machine slows them alike. The differences are the cost of the harness, of bwrap and of
joining the cgroup (a migration waits for an RCU grace period: idle time, not CPU).

Throughput: the ``code`` reward on a batch of ``--samples`` completions (half stdin/stdout rows
with 3 cases each, half assert rows with 3 asserts each; right, wrong and crashing programs
mixed), ``--workers`` programs at once; programs/s and jailed runs/s over ``--batches``
batches (median).

    .venv/bin/python benchmarks/sandbox_throughput.py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import time
import warnings

from timing import take_turns

from posttrain.rewards.code import CodeReward
from posttrain.rewards.sandbox import Limits, Sandbox


def batch(samples: int) -> tuple[list[str], list[list[dict]]]:
    completions, tests = [], []
    for i in range(samples):
        kind = i % 3  # 0 right, 1 wrong, 2 crashes
        if i % 2 == 0:
            body = ["print(sum(map(int, input().split())))", "print(0)", "raise ValueError"][kind]
            tests.append([{"input": f"{i} {j}", "output": str(i + j)} for j in range(3)])
        else:
            body = ["def f(x):\n    return 2 * x", "def f(x):\n    return x", "def f(x):\n    return 1 / 0"][kind]
            tests.append([{"assert": f"assert f({j}) == {2 * j}"} for j in range(1, 4)])
        completions.append(f"```python\n{body}\n```")
    return completions, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    limits = Limits(wall_s=5, cpu_s=5, memory_mb=512)
    jailed = Sandbox(limits)
    jailed.check()
    no_cgroup = Sandbox(limits)
    no_cgroup.cgroups = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unjailed = Sandbox(limits, unsafe_local=True)
    unjailed.cgroups = None
    plain = [jailed.python, "-I", "-S", "-c", "print(1)"]
    startup = take_turns(
        {
            "plain_python": lambda: subprocess.run(plain, capture_output=True, check=True),
            "harness": lambda: unjailed.run_io("print(1)", "", "1"),
            "harness_in_jail": lambda: no_cgroup.run_io("print(1)", "", "1"),
            "harness_in_jail_and_cgroup": lambda: jailed.run_io("print(1)", "", "1"),
            "asserts_in_jail_and_cgroup": lambda: jailed.run_asserts("def f(): return 1", ["assert f() == 1"]),
        },
        args.repeats,
    )
    ms = {name: round(1000 * seconds, 1) for name, seconds in startup.items()}

    reward = CodeReward(limits=limits, workers=args.workers)
    completions, tests = batch(args.samples)
    runs = sum(len(t) for t in tests[::2]) + len(tests[1::2])  # one run per stdin case, one per assert row
    seconds = []
    for _ in range(args.batches):
        start = time.perf_counter()
        output = reward(["p"] * args.samples, completions, tests=tests)
        seconds.append(time.perf_counter() - start)
    per_batch = statistics.median(seconds)
    report = {
        "machine": {"cores": len(os.sched_getaffinity(0)), "runner": jailed.runner, "tasks": jailed.containment},
        "startup_ms": ms,
        "overhead_ms": {
            "harness": round(ms["harness"] - ms["plain_python"], 1),
            "bwrap": round(ms["harness_in_jail"] - ms["harness"], 1),
            "cgroup": round(ms["harness_in_jail_and_cgroup"] - ms["harness_in_jail"], 1),
            "jail_and_cgroup_over_plain_python": round(ms["harness_in_jail_and_cgroup"] - ms["plain_python"], 1),
        },
        "throughput": {
            "samples": args.samples,
            "workers": args.workers,
            "jailed_runs_per_batch": runs,
            "seconds_per_batch": round(per_batch, 3),
            "programs_per_s": round(args.samples / per_batch, 1),
            "runs_per_s": round(runs / per_batch, 1),
            "mean_reward": round(sum(v for v in output.values if v is not None) / args.samples, 3),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
