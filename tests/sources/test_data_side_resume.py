"""Each data-side feature over environment episodes resumes exactly (issue 36, acceptance): a run
killed after step 2 and continued with ``resume: auto`` logs the straight run's metrics and ends
on its weights, synchronously and with ``rollout.max_staleness: 1`` (the features then sit in the
producer, which runs ahead: the checkpoint holds their state as of the batches produced).

The kill is simulated as in tests/train/test_resume.py: the straight run's folder is copied
without what came after the checkpoint and a fresh ``OnlineRL`` continues it."""

from __future__ import annotations

import shutil

import pytest
import torch

from posttrain.run.checkpoint import checkpoint_root
from posttrain.train.rl import OnlineRL

from .test_data_side import episode_run

pytestmark = pytest.mark.slow
STEPS, KILLED_AFTER = 4, 2
FEATURES = {
    "dynamic_sampling": ["algorithm=grpo", "algorithm.dynamic_sampling.enabled=true"],
    "overlong": ["algorithm=grpo", "algorithm.overlong.enabled=true", "algorithm.overlong.max_length=8"],
    "greedy_baseline": ["algorithm=remax"],
    "difficulty_filter": ["algorithm=grpo", "data.filter.pass_rate=[0.1, 0.9]", "data.filter.k=2"],
    "curriculum": ["algorithm=grpo", "data.curriculum.column=level", "data.curriculum.levels=[0, 1]",
                   "data.curriculum.window=1", "data.curriculum.advance_at=0.9"],
}  # fmt: skip


def comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in history]


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_killed_run_with_the_feature_resumes_to_the_straight_run(tmp_path, feature, staleness):
    extra = [*FEATURES[feature], f"rollout.max_staleness={staleness}", f"steps={STEPS}", "save_every=1"]
    extra += [f"keep_last={STEPS}", "rollout.producer_threads=1", "threads=2"]  # equal threads: equal floats
    straight_run = episode_run(tmp_path, extra, "straight")
    straight = straight_run.run()
    if feature == "curriculum":
        assert [h["curriculum/level"] for h in straight] == [0.0, 1.0, 1.0, 1.0]
    final = {k: v.clone() for k, v in straight_run.policy.state_dict().items()}

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed_dir)
    shutil.rmtree(resumed_dir / "final")
    for path in checkpoint_root(resumed_dir).iterdir():
        if int(path.name.split("-")[1]) > KILLED_AFTER:
            shutil.rmtree(path)
    run: OnlineRL = episode_run(tmp_path, [*extra, f"output_dir={resumed_dir}", "resume=auto"], "unused")
    resumed = run.run()
    assert comparable(resumed) == comparable(straight[KILLED_AFTER:])
    state = run.policy.state_dict()
    assert all(torch.equal(state[k], final[k]) for k in final)
