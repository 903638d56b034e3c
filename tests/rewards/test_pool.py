"""Reward functions in worker processes: timeouts and crashes cost only their own samples,
chunks keep the batch order, and the pool is reused and closed."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from posttrain.rewards import (
    NamedReward,
    RewardFunctionError,
    RewardOutput,
    RewardPoolWarning,
    RewardSet,
    resolve_reward,
)
from posttrain.rewards.pool import Task, WorkerPool, pickled_function, split_batch

# Worker processes import these by name (tests.rewards.test_pool:...), so they live at the top level.


def row_index(prompts, completions, completion_ids, **columns):
    return [float(i) for i in columns["row"]]


def digest(prompts, completions, completion_ids, **columns):
    texts = [f"{p}|{c}" for p, c in zip(prompts, completions, strict=True)]
    return [int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) / 2**32 for t in texts]


def sleep_forever(prompts, completions, completion_ids, **columns):
    time.sleep(10**6)


def exit_on_crash(prompts, completions, completion_ids, **columns):
    if "crash" in completions:
        os._exit(3)
    return [1.0] * len(completions)


def segfault_on_crash(prompts, completions, completion_ids, **columns):
    if "crash" in completions:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return [1.0] * len(completions)


def start_child_then_hang(prompts, completions, completion_ids, **columns):
    child = subprocess.Popen(["sleep", "1000"])
    Path(columns["pid_file"][0]).write_text(str(child.pid))
    time.sleep(10**6)


def worker_pid(prompts, completions, completion_ids, **columns):
    return RewardOutput([float(os.getpid())] * len(completions), metrics={"size": float(len(completions))})


def divide_by_zero(prompts, completions, completion_ids, **columns):
    return [1 / 0 for _ in completions]


async def async_double(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(0.01)
    return [2.0 * len(c) for c in completions]


async def async_forever(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(10**6)


def batch(n, **columns):
    return [f"p{i}" for i in range(n)], [f"c{i}" for i in range(n)], [[i] for i in range(n)], columns


@pytest.fixture
def rewards_of():
    """RewardSets that are closed after the test."""
    made = []

    def make(*rewards, **options):
        made.append(RewardSet(list(rewards), **options))
        return made[-1]

    yield make
    for reward_set in made:
        reward_set.close()


@pytest.mark.parametrize(("size", "chunks"), [(10, 3), (3, 8), (1, 1), (0, 4), (7, 7)])
def test_split_batch_covers_the_batch_in_order(size, chunks):
    parts = split_batch(size, chunks)
    covered = [i for part in parts for i in range(size)[part]]
    assert covered == list(range(size))
    lengths = [part.stop - part.start for part in parts]
    assert max(lengths) - min(lengths) <= 1 and len(parts) == max(1, min(chunks, size))


def test_chunks_keep_the_order_of_the_batch(rewards_of):
    rewards = rewards_of(NamedReward("row", row_index, chunks=3), workers=3)
    prompts, completions, ids, columns = batch(10, row=list(range(10)))
    result = rewards.score(prompts, completions, ids, columns)
    assert rewards.modes == {"row": "pool"}
    assert result.components[:, 0].tolist() == [float(i) for i in range(10)]


def test_one_worker_and_two_workers_give_the_same_values(rewards_of):
    prompts, completions, ids, columns = batch(9, answer=[str(i) for i in range(9)])
    completions[2] = "<answer>2</answer>"
    specs = [NamedReward("digest", digest), resolve_reward("math")]
    one = rewards_of(*specs, workers=1).score(prompts, completions, ids, columns)
    two = rewards_of(*specs, workers=2).score(prompts, completions, ids, columns)
    assert one.components.tolist() == two.components.tolist()
    assert one.components[2, 1] == 1.0 and one.components[:, 0].unique().numel() == 9


def test_chunks_run_in_different_workers_and_metrics_are_averaged_by_size(rewards_of):
    rewards = rewards_of(NamedReward("pid", worker_pid, chunks=2), workers=2)
    rewards.start()  # both ready, so each takes one chunk
    result = rewards.score(*batch(5))
    assert len(set(result.components[:, 0].tolist())) == 2  # two chunks (3 + 2 rows), two workers
    assert result.metrics["reward/pid/size"] == pytest.approx((3 * 3 + 2 * 2) / 5)
    assert os.getpid() not in result.components[:, 0].tolist()


def test_a_call_that_hangs_times_out_and_the_rest_of_the_batch_is_kept(rewards_of):
    hang = NamedReward("hang", sleep_forever, timeout_s=1.0, max_failed_fraction=1.0)
    rewards = rewards_of(NamedReward("row", row_index), hang, workers=2)
    prompts, completions, ids, columns = batch(4, row=list(range(4)))
    rewards.start()  # the clock of a call starts when a ready worker takes it
    start = time.perf_counter()
    result = rewards.score(prompts, completions, ids, columns)
    assert time.perf_counter() - start < 1.0 + 2.0
    assert result.components[:, 1].isnan().all() and result.components[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert result.metrics["reward/hang/timeouts"] == 4 and result.metrics["reward/row/timeouts"] == 0
    # a reward that timed out leaves its samples unscored, never scored by the others alone
    assert result.scores.isnan().all() and result.metrics["reward/hang/failed_fraction"] == 1.0
    # the killed workers were replaced: the next call works
    again = rewards.score(prompts, completions, ids, columns)
    assert again.components[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_timeout_from_the_config_entry_applies_to_that_reward(rewards_of):
    spec = {"name": "tests.rewards.test_pool:sleep_forever", "timeout": 1, "alias": "slow", "max_failed_fraction": 1}
    entry = resolve_reward(spec)
    assert entry.name == "slow" and entry.timeout_s == 1.0 and entry.max_failed_fraction == 1
    rewards = rewards_of(entry, workers=1, timeout_s=None)
    rewards.start()
    start = time.perf_counter()
    result = rewards.score(*batch(2))
    assert time.perf_counter() - start < 1.0 + 2.0 and result.metrics["reward/slow/timeouts"] == 2
    for bad in (0, -1, "soon"):
        with pytest.raises(ValueError, match="timeout must be"):
            resolve_reward({"name": "format", "timeout": bad})
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        resolve_reward({"name": "format", "chunks": 0})


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_timeout_kills_the_programs_the_function_started(rewards_of, tmp_path):
    pid_file = tmp_path / "child.pid"
    rewards = rewards_of(NamedReward("child", start_child_then_hang, timeout_s=1.0), workers=1, max_failed_fraction=1)
    rewards.score(["p"], ["c"], [[1]], {"pid_file": [str(pid_file)]})
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not running(child)


def running(pid):
    """Alive and not a zombie (a container's PID 1 may never reap the killed child)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.parametrize("crasher", [exit_on_crash, segfault_on_crash])
def test_a_crashing_worker_costs_only_its_chunk_and_is_replaced(rewards_of, crasher):
    rewards = rewards_of(NamedReward("crashy", crasher, chunks=2), NamedReward("row", row_index), workers=2)
    prompts, _, ids, columns = batch(4, row=list(range(4)))
    result = rewards.score(prompts, ["a", "b", "c", "crash"], ids, columns)
    assert result.components[:2, 0].tolist() == [1.0, 1.0] and result.components[2:, 0].isnan().all()
    assert result.metrics["reward/crashy/crashes"] == 2 and result.metrics["reward/crashy/timeouts"] == 0
    assert result.components[:, 1].tolist() == [0.0, 1.0, 2.0, 3.0]
    again = rewards.score(prompts, ["a", "b", "c", "d"], ids, columns)
    assert again.components[:, 0].tolist() == [1.0] * 4 and again.metrics["reward/crashy/crashes"] == 0
    assert rewards._pool.started == 3  # two workers, one replacement for the one that died


def test_workers_are_reused_between_calls_and_stopped_by_close():
    with RewardSet([NamedReward("pid", worker_pid, chunks=2)], workers=2) as rewards:
        first = set(rewards.score(*batch(4)).components[:, 0].tolist())
        second = set(rewards.score(*batch(4)).components[:, 0].tolist())
        processes = [w.process for w in rewards._pool._workers]
        # which worker takes which chunk is the scheduler's (a busy machine may give one worker
        # both): every chunk of both calls ran in one of the two workers started once
        assert first | second <= {float(p.pid) for p in processes} and rewards._pool.started == 2
    assert all(p.poll() is not None for p in processes)


def test_an_error_in_a_worker_names_the_function_and_keeps_the_traceback(rewards_of):
    rewards = rewards_of(NamedReward("broken", divide_by_zero), workers=2)
    with pytest.raises(RewardFunctionError, match=r"'broken' raised ZeroDivisionError: division by zero") as error:
        rewards.score(*batch(3))
    assert "in divide_by_zero" in str(error.value)  # the worker's traceback


def test_functions_a_worker_cannot_receive_run_in_threads_with_one_warning(rewards_of):
    def nested(prompts, completions, completion_ids, **columns):
        return [float(threading.current_thread().daemon)] * len(completions)

    assert pickled_function(nested)[0] is None and pickled_function(row_index)[0] is not None
    with pytest.warns(RewardPoolWarning, match=r"'nested' runs in a thread.*cannot be pickled"):
        rewards = rewards_of(NamedReward("nested", nested), workers=2)
    assert rewards.modes == {"nested": "thread"}
    assert rewards.score(*batch(2)).components[:, 0].tolist() == [1.0, 1.0]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewards_of(NamedReward("nested", nested), workers=2)  # warned once already


def test_a_thread_that_hangs_times_out_without_holding_the_run(rewards_of):
    release = threading.Event()

    def stuck(prompts, completions, completion_ids, **columns):
        release.wait()
        return [1.0] * len(completions)

    rewards = rewards_of(NamedReward("stuck", stuck, timeout_s=0.5), workers=0, max_failed_fraction=1.0)
    start = time.perf_counter()
    result = rewards.score(*batch(3))
    assert time.perf_counter() - start < 0.5 + 2.0
    assert result.components.isnan().all() and result.metrics["reward/stuck/timeouts"] == 3
    release.set()


def test_async_functions_still_work_and_time_out(rewards_of):
    rewards = rewards_of(
        NamedReward("double", async_double),
        NamedReward("never", async_forever, timeout_s=0.5, max_failed_fraction=1.0),
        NamedReward("row", row_index),
        workers=2,
    )
    assert rewards.modes == {"double": "async", "never": "async", "row": "pool"}
    prompts, _, ids, columns = batch(3, row=[0, 1, 2])
    result = rewards.score(prompts, ["a", "bb", "ccc"], ids, columns)
    assert result.components[:, 0].tolist() == [2.0, 4.0, 6.0] and result.components[:, 2].tolist() == [0.0, 1.0, 2.0]
    assert result.components[:, 1].isnan().all() and result.metrics["reward/never/timeouts"] == 3


def test_a_function_that_raises_timeout_error_itself_is_an_error_not_a_timeout(rewards_of):
    async def gives_up(prompts, completions, completion_ids, **columns):
        raise TimeoutError("upstream server")

    with pytest.raises(RewardFunctionError, match="raised TimeoutError: upstream server"):
        rewards_of(NamedReward("gives_up", gives_up)).score(*batch(1))


def test_the_pool_reports_each_task_on_its_own():
    pool = WorkerPool(2)
    try:
        fn, _ = pickled_function(exit_on_crash)
        calls = [{"prompts": [], "completions": c, "completion_ids": []} for c in (["a"], ["crash"], ["b"])]
        tasks = [Task(0, fn, kwargs) for kwargs in calls]
        results = pool.run(tasks)
        assert [r.status for r in results] == ["ok", "crash", "ok"] and "exit code 3" in results[1].error
        assert [r.status for r in pool.run(tasks[::2])] == ["ok", "ok"]
        assert pool.started == 3  # two, and one in place of the one that died
    finally:
        pool.close()
