"""Reward workers as Ray tasks (rewards/ray_pool.py, cluster.kind: ray): the same scores as the
local worker processes, computed in Ray's processes; a call past its timeout is cancelled and
costs only its samples; a task whose process dies costs only its chunk; an error names the
function — the local pool's behaviour, on a cluster."""

from __future__ import annotations

import os
import time

import pytest

from posttrain.rewards import NamedReward, RewardFunctionError, RewardSet
from posttrain.rewards.ray_pool import RayTaskPool
from tests.rewards.test_pool import batch, digest, divide_by_zero, exit_on_crash, row_index, sleep_forever, worker_pid

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'posttrain[dist]'")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def on_ray(cluster):
    made = []

    def make(*rewards, **options):
        made.append(RewardSet(list(rewards), workers=2, pool=RayTaskPool, **options))
        return made[-1]

    yield make
    for reward_set in made:
        reward_set.close()


def test_ray_tasks_score_like_local_workers_outside_the_learner(on_ray):
    prompts, completions, ids, columns = batch(9, row=list(range(9)))
    specs = [NamedReward("digest", digest), NamedReward("row", row_index), NamedReward("pid", worker_pid, chunks=2)]
    with RewardSet(specs[:2], workers=2) as local:
        expected = local.score(prompts, completions, ids, columns).components
    result = on_ray(*specs).score(prompts, completions, ids, columns)
    assert result.components[:, :2].tolist() == expected.tolist()
    assert os.getpid() not in result.components[:, 2].tolist()  # computed in Ray's worker processes


def test_a_task_past_its_timeout_is_cancelled_and_costs_only_its_samples(on_ray):
    hang = NamedReward("hang", sleep_forever, timeout_s=2.0, max_failed_fraction=1.0)
    rewards = on_ray(NamedReward("row", row_index), hang)
    prompts, completions, ids, columns = batch(4, row=list(range(4)))
    start = time.perf_counter()
    result = rewards.score(prompts, completions, ids, columns)
    assert time.perf_counter() - start < 2.0 + 10.0
    assert result.components[:, 1].isnan().all() and result.components[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert result.metrics["reward/hang/timeouts"] == 4 and result.metrics["reward/row/timeouts"] == 0


def test_a_task_whose_process_dies_costs_only_its_chunk(on_ray):
    rewards = on_ray(NamedReward("crashy", exit_on_crash, chunks=2, max_failed_fraction=1.0))
    result = rewards.score(*batch(4)[:1], ["a", "b", "c", "crash"], *batch(4)[2:])
    assert result.components[:2, 0].tolist() == [1.0, 1.0] and result.components[2:, 0].isnan().all()
    assert result.metrics["reward/crashy/crashes"] == 2
    again = rewards.score(*batch(4))
    assert again.components[:, 0].tolist() == [1.0] * 4


def test_an_error_in_a_task_names_the_function(on_ray):
    with pytest.raises(RewardFunctionError, match=r"'broken' raised ZeroDivisionError: division by zero"):
        on_ray(NamedReward("broken", divide_by_zero)).score(*batch(3))
