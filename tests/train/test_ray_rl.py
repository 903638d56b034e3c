"""posttrain rl with cluster.kind: ray: the loop and the sources run unchanged on the Ray rollout
workers (rollout/ray_engine.py) — synchronous and with rollout.max_staleness; a worker killed in
the middle of a run is started again and the run goes on, saying so; without Ray installed the
config is refused before any model loads, with the install command."""

from __future__ import annotations

import sys

import pytest

from posttrain.cli import main
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from tests.train.test_rl import SMALL, TINY, vowel_share

RAY = ["cluster.kind=ray", "cluster.rollout_workers=2", "rollout.engine=native"]


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'posttrain[dist]'")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield ray
    ray.shutdown()


def workers(run: OnlineRL):
    """The run's Ray engine: the loop's own, or the asynchronous producer's."""
    return run.source.engine if run.config.rollout.max_staleness else run.engine


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_worker_killed_mid_run_is_restarted_and_the_run_completes(cluster, tmp_path, staleness):
    lines: list[str] = []
    holder: dict[str, OnlineRL] = {}
    calls = {"n": 0}

    def killing_reward(prompts, completions, completion_ids, **columns):
        calls["n"] += 1
        if calls["n"] == 2:  # while step 2 is scored (with staleness 1, step 3 may be sampling)
            cluster.kill(workers(holder["run"]).workers[1])
        return vowel_share(prompts, completions, completion_ids, **columns)

    overrides = [*TINY, *SMALL, *RAY, "steps=4", f"rollout.max_staleness={staleness}", f"output_dir={tmp_path}"]
    run = OnlineRL(load_rl_config(None, overrides), reward_functions=[killing_reward], echo=lines.append)
    holder["run"] = run
    history = run.run()
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert all(m["policy/grad_norm"] > 0 for m in history)
    deaths = [line for line in lines if line.startswith("[ray] rollout worker 1 died")]
    assert len(deaths) == 1 and "1 of at most 3 deaths" in deaths[0]
    assert not workers(run).workers  # the run stopped its workers at the end


def test_without_ray_the_config_is_refused_before_loading_with_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    args = ["rl", *TINY, *SMALL, *RAY, "steps=1", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cluster.kind = 'ray' needs Ray, which is not installed: pip install 'posttrain[dist]'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_run_starts_its_own_local_cluster_scores_on_it_and_stops_it(tmp_path):
    """No cluster.address: the run starts a local cluster with room for the rollout workers and the
    reward tasks (on a machine whose cores the workers reserve, tasks once waited forever), and
    stops it at the end."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'posttrain[dist]'")
    import subprocess

    args = ["rl", *TINY, *SMALL, *RAY, "reward_workers=2", "rewards=[tests.train.test_rl:vowel_share]", "steps=2",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rl] done" in result.stdout and (tmp_path / "run" / "final").is_dir()
    assert "reward/vowel_share/failed_fraction" in (tmp_path / "run" / "metrics.jsonl").read_text()
