"""Injected runner faults (issue 7 acceptance): every one is an ``infra_error``, none becomes a
reward of 0, no other sample of the batch changes, and too many of them stop the run with a
message naming the runner."""

from __future__ import annotations

import math
import stat

import pytest

from posttrain.rewards.code import CodeReward, SandboxInfraError
from posttrain.rewards.sandbox import Sandbox, SandboxUnavailable, Verdict

from .conftest import LIMITS, require_bwrap


@pytest.fixture
def broken_bwrap(tmp_path) -> str:
    """A bwrap that fails the way it does where user namespaces are off."""
    path = tmp_path / "bwrap"
    path.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel does not "
        "allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_jail_that_cannot_start_is_refused_with_what_to_do(broken_bwrap):
    box = Sandbox(LIMITS, bwrap=broken_bwrap)
    with pytest.raises(SandboxUnavailable) as error:
        box.check()
    message = str(error.value)
    assert "No permissions to creating new namespace" in message
    assert "apt-get install bubblewrap" in message and "unprivileged_userns_clone" in message
    assert "unsafe_local=True" in message
    with pytest.raises(SandboxUnavailable):
        CodeReward(sandbox=box)


def test_jail_start_failure_is_an_infra_error_for_every_case(broken_bwrap):
    box = Sandbox(LIMITS, bwrap=broken_bwrap)
    assert box.run_io("print(1)", "", "1").verdict is Verdict.INFRA_ERROR
    results = box.run_asserts("def f(): return 1", ["assert f() == 1", "assert f() == 2"])
    assert [r.verdict for r in results] == [Verdict.INFRA_ERROR] * 2
    assert "No permissions" in results[0].detail


def test_missing_bwrap_cgroup_failure_and_runner_exceptions_are_infra_errors(sandbox, monkeypatch):
    require_bwrap()
    missing = Sandbox(LIMITS, bwrap="/nonexistent/bwrap")
    result = missing.run_io("print(1)", "", "1")
    assert result.verdict is Verdict.INFRA_ERROR and "FileNotFoundError" in result.detail

    box = Sandbox(LIMITS)
    if box.cgroups is not None:

        def no_cgroup(*args, **kwargs):
            raise PermissionError("cgroup.procs: permission denied")

        monkeypatch.setattr(box.cgroups, "acquire", no_cgroup)
        assert box.run_io("print(1)", "", "1").verdict is Verdict.INFRA_ERROR

    def explode(*args, **kwargs):
        raise RuntimeError("runner bug")

    monkeypatch.setattr("posttrain.rewards.sandbox.supervise", explode)
    result = sandbox.run_asserts("def f(): return 1", ["assert f() == 1"])[0]
    assert result.verdict is Verdict.INFRA_ERROR and "runner bug" in result.detail


def _batch() -> tuple[list[str], list[list[dict]]]:
    """64 samples: stdin/stdout rows and assert rows, right and wrong programs."""
    completions, tests = [], []
    for i in range(64):
        if i % 2 == 0:
            body = "print(sum(map(int, input().split())))" if i % 4 == 0 else "print(0)"
            tests.append([{"input": f"{i} 1", "output": str(i + 1)}])
        else:
            body = "def f(x):\n    return x * 2" if i % 3 else "def f(x):\n    return x"
            tests.append([{"assert": f"assert f({i}) == {2 * i}"}, {"assert": "assert f(0) == 0"}])
        completions.append(f"Here you go:\n```python\n# sample {i}\n{body}\n```")
    return completions, tests


def test_one_fault_in_a_batch_of_64_masks_only_that_sample(sandbox, monkeypatch):
    reward = CodeReward(sandbox=sandbox, workers=4)
    completions, tests = _batch()
    clean = reward(["p"] * 64, completions, tests=tests)
    assert None not in clean.values and 0.0 in clean.values and 1.0 in clean.values

    execute = sandbox._execute

    def one_fault(mode, payload, cap):
        if "# sample 17\n" in payload["source"]:
            return "injected fault"
        return execute(mode, payload, cap)

    monkeypatch.setattr(sandbox, "_execute", one_fault)
    faulty = reward(["p"] * 64, completions, tests=tests)
    assert faulty.values[17] is None
    assert [v for i, v in enumerate(faulty.values) if i != 17] == [v for i, v in enumerate(clean.values) if i != 17]
    assert faulty.metrics["infra_error_share"] == pytest.approx(1 / 64)

    strict = CodeReward(sandbox=sandbox, workers=4, max_infra_error_share=0.0)
    with pytest.raises(SandboxInfraError, match=r"runner bubblewrap \(.*\) failed on 1 of 64 programs.*injected"):
        strict(["p"] * 64, completions, tests=tests)


def test_a_batch_whose_jail_never_starts_is_masked_or_stops_the_run(broken_bwrap, monkeypatch):
    require_bwrap()
    reward = CodeReward(sandbox=Sandbox(LIMITS), max_infra_error_share=1.0)
    reward.sandbox = Sandbox(LIMITS, bwrap=broken_bwrap)  # the jail breaks after start-up
    completions, tests = _batch()
    output = reward(["p"] * 64, completions[:8], tests=tests[:8])
    assert output.values == [None] * 8  # masked, never 0
    assert output.metrics["verdict/infra_error"] == 1.0
    reward.max_infra_error_share = 0.5
    with pytest.raises(SandboxInfraError, match="failed on 8 of 8 programs"):
        reward(["p"] * 8, completions[:8], tests=tests[:8])
    assert not math.isnan(output.metrics["programs_per_s"])
