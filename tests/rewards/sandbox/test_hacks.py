"""The reward-hacking corpus (issue 7 acceptance): every hack scores 0 passes, the honest
solutions pass everything, and ``os._exit(0)`` before the tests is a ``crash``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.rewards.sandbox import Verdict

from .hacks import ASSERT_HACKS, ASSERT_TESTS, HONEST_ASSERT, HONEST_IO, IO_CASES, IO_HACKS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judged(sandbox) -> dict[str, list]:
    def judge(item):
        name, source = item
        if name in IO_HACKS or name == "honest_io":
            return name, [sandbox.run_io(source, i, o) for i, o in IO_CASES]
        return name, sandbox.run_asserts(source, ASSERT_TESTS)

    programs = {**ASSERT_HACKS, **IO_HACKS, "honest_assert": HONEST_ASSERT, "honest_io": HONEST_IO}
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(judge, programs.items()))


def test_the_corpus_is_large_enough_and_compiles():
    assert len(ASSERT_HACKS) + len(IO_HACKS) >= 30
    for name, source in {**ASSERT_HACKS, **IO_HACKS}.items():
        compile(source, name, "exec")  # a hack that does not compile would score 0 for nothing


def test_honest_solutions_pass_every_test(judged):
    for name in ("honest_assert", "honest_io"):
        assert [r.verdict for r in judged[name]] == [Verdict.PASS] * len(judged[name]), judged[name]


@pytest.mark.parametrize("name", sorted({**ASSERT_HACKS, **IO_HACKS}))
def test_hack_scores_no_pass(name, judged):
    results = judged[name]
    assert len(results) == (len(IO_CASES) if name in IO_HACKS else len(ASSERT_TESTS))
    passed = [i for i, r in enumerate(results) if r.verdict is Verdict.PASS]
    assert passed == [], f"{name} passed tests {passed}: {results}"
    assert all(r.verdict is not Verdict.INFRA_ERROR for r in results), results


@pytest.mark.parametrize("name", ["os_exit_before_tests", "sys_exit_before_tests", "os_exit_after_definitions"])
def test_exiting_before_the_tests_is_a_crash(name, judged):
    assert {r.verdict for r in judged[name]} == {Verdict.CRASH}, judged[name]


def test_stopping_the_referee_is_a_timeout_and_killing_it_a_crash(judged):
    assert {r.verdict for r in judged["stop_referee"]} == {Verdict.TIMEOUT}
    assert {r.verdict for r in judged["kill_referee"]} == {Verdict.CRASH}
