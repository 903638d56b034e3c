"""The ``code`` reward: run the program a completion wrote against the row's test cases in the
sandbox (``sandbox.py``); the reward is the fraction of test cases that pass.

Test cases come from a dataset column (``tests`` by default), per row a list — or a JSON string
of a list — whose items are

- ``{"input": "1 2\\n", "output": "3\\n"}``: a stdin/stdout case, one jailed run each;
- ``{"assert": "assert add(1, 2) == 3"}`` or a bare string: Python test code that refers to the
  program's names (one or more statements, e.g. HumanEval's ``check(candidate)``); all of a
  row's assert cases share one jailed run and are judged by the referee process;

or, APPS-style, a mapping ``{"inputs": [...], "outputs": [...]}``.

The program is the last fenced block tagged ``python`` (or ``py``, ``python3``), else the whole
completion. A sample with an ``infra_error`` verdict gets ``None`` (masked out of the advantage,
never scored 0); when more than ``max_infra_error_share`` of a batch's samples have one, the
reward raises :class:`SandboxInfraError` naming the runner.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.rewards.registry import RewardOutput, register_reward
from posttrain.rewards.rules import completion_text
from posttrain.rewards.sandbox import CaseResult, Limits, Sandbox, Verdict

_FENCE = re.compile(r"```(?:python3?|py)[^\S\n]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


class SandboxInfraError(PosttrainError, RuntimeError):
    """Too many samples of a batch could not be judged because the runner failed."""


@dataclass(frozen=True)
class TestCase:
    """A stdin/stdout case (``code`` is None) or an assert-style case (``code`` is set)."""

    __test__ = False  # not a pytest class

    input: str = ""
    output: str = ""
    code: str | None = None


def extract_program(text: str) -> str:
    """The last ```python fenced block of a completion, else the whole text."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def parse_tests(value: Any, row: int = 0) -> list[TestCase]:
    """One row's ``tests`` value → test cases. Raises ValueError naming the row on bad data
    (assert code is compiled here, never run, so a broken dataset fails before training)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"code reward: tests of row {row} are a string but not JSON: {error}") from None
    if isinstance(value, Mapping) and "inputs" in value and "outputs" in value:
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"], strict=True)]
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"code reward: tests of row {row} must be a list, got {type(value).__name__}")
    cases = []
    for j, item in enumerate(value):
        if isinstance(item, str):
            item = {"assert": item}
        if isinstance(item, Mapping) and "assert" in item:
            try:
                compile(str(item["assert"]), f"<row {row} test {j}>", "exec")
            except SyntaxError as error:
                raise ValueError(f"code reward: test {j} of row {row} does not compile: {error}") from None
            cases.append(TestCase(code=str(item["assert"])))
        elif isinstance(item, Mapping) and "input" in item and "output" in item:
            cases.append(TestCase(input=str(item["input"]), output=str(item["output"])))
        else:
            raise ValueError(
                f"code reward: test {j} of row {row} must be {{input, output}}, {{assert}} or a string, got {item!r}"
            )
    return cases


def run_cases(sandbox: Sandbox, program: str, cases: Sequence[TestCase], pool: ThreadPoolExecutor) -> list[Any]:
    """Submit one program's cases; returns futures, each resolving to a list of CaseResult in
    case order (stdin/stdout cases one future each, assert cases one future together)."""
    futures = [pool.submit(_guarded, sandbox.run_io, 1, program, c.input, c.output) for c in cases if c.code is None]
    asserts = [c.code for c in cases if c.code is not None]
    if asserts:
        futures.append(pool.submit(_guarded, sandbox.run_asserts, len(asserts), program, asserts))
    return futures


def _guarded(fn: Any, n: int, *args: Any) -> list[CaseResult]:
    # a bug or an OS error in the runner is the runner's fault, never the program's
    try:
        result = fn(*args)
        return result if isinstance(result, list) else [result]
    except Exception as error:
        return [CaseResult(Verdict.INFRA_ERROR, f"runner raised {type(error).__name__}: {error}")] * n


@register_reward("code")
class CodeReward:
    """Fraction of the row's test cases the completion's program passes, run in the sandbox.

    Options: ``limits`` (a mapping of :class:`Limits` fields, e.g. ``{wall_s: 5}``), ``workers``
    (jailed runs at once; default: the CPU cores, so a CPU-bound program gets a whole core and
    its time verdict does not depend on its neighbours — short programs spend ~20 ms of each
    run idle in jail set-up, so 2× cores gives them ~35 % more throughput, see
    ``benchmarks/sandbox_throughput.py``), ``unsafe_local`` (run without the jail —
    only for machines without user namespaces, warned about), ``max_infra_error_share`` (stop
    the run when more of a batch's samples than this could not be judged), ``tests_column``.
    The jail is checked at construction: no jail, no reward (unless ``unsafe_local``).
    """

    def __init__(
        self,
        limits: Mapping[str, Any] | Limits | None = None,
        workers: int | None = None,
        unsafe_local: bool = False,
        max_infra_error_share: float = 0.1,
        tests_column: str = "tests",
        bwrap: str = "bwrap",
        python: str | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        if not 0.0 <= max_infra_error_share <= 1.0:
            raise ValueError(f"max_infra_error_share must be in [0, 1], got {max_infra_error_share}")
        if isinstance(limits, Mapping):
            limits = Limits(**limits)
        self.sandbox = sandbox or Sandbox(limits, unsafe_local=unsafe_local, bwrap=bwrap, python=python)
        self.sandbox.check()
        self.workers = workers or len(os.sched_getaffinity(0))
        self.max_infra_error_share = max_infra_error_share
        self.tests_column = tests_column

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any
    ) -> RewardOutput:
        if self.tests_column not in columns:
            raise ValueError(
                f"reward 'code' needs a test-case column {self.tests_column!r}; the dataset has: "
                f"{', '.join(sorted(columns)) or 'no extra columns'}"
            )
        cases = [parse_tests(value, row) for row, value in enumerate(columns[self.tests_column])]
        programs = [extract_program(completion_text(c)) for c in completions]
        start = time.perf_counter()
        results = self.judge(programs, cases)
        seconds = time.perf_counter() - start
        return RewardOutput(self._rewards(results), _metrics(results, seconds))

    def judge(self, programs: Sequence[str], cases: Sequence[Sequence[TestCase]]) -> list[list[CaseResult]]:
        """Every program against its cases, concurrently; results in case order per program."""
        if len(programs) != len(cases):
            raise ValueError(f"{len(programs)} programs but {len(cases)} rows of tests")
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="code-reward") as pool:
            submitted = [run_cases(self.sandbox, p, c, pool) for p, c in zip(programs, cases, strict=True)]
            ordered = []
            for row_cases, futures in zip(cases, submitted, strict=True):
                flat = [r for f in futures for r in f.result()]
                io_results = iter(flat[: sum(c.code is None for c in row_cases)])
                assert_results = iter(flat[sum(c.code is None for c in row_cases) :])
                ordered.append([next(io_results) if c.code is None else next(assert_results) for c in row_cases])
        return ordered

    def _rewards(self, results: list[list[CaseResult]]) -> list[float | None]:
        rewards: list[float | None] = []
        failed = []
        for row in results:
            infra = [r for r in row if r.verdict is Verdict.INFRA_ERROR]
            if infra:
                failed.append(infra[0].detail)
                rewards.append(None)
            else:
                rewards.append(sum(r.verdict is Verdict.PASS for r in row) / len(row) if row else None)
        if results and len(failed) / len(results) > self.max_infra_error_share:
            raise SandboxInfraError(
                f"code sandbox runner {self.sandbox.runner} failed on {len(failed)} of {len(results)} programs "
                f"(more than max_infra_error_share={self.max_infra_error_share}); first error: {failed[0]}"
            )
        return rewards


def _metrics(results: list[list[CaseResult]], seconds: float) -> dict[str, float]:
    counts = Counter(r.verdict for row in results for r in row)
    total = max(sum(counts.values()), 1)
    metrics = {f"verdict/{v.value}": counts[v] / total for v in Verdict}
    infra_rows = sum(any(r.verdict is Verdict.INFRA_ERROR for r in row) for row in results)
    metrics["infra_error_share"] = infra_rows / max(len(results), 1)
    metrics["no_tests_share"] = sum(not row for row in results) / max(len(results), 1)
    metrics["programs_per_s"] = len(results) / seconds if seconds > 0 else 0.0
    return metrics
