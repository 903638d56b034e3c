"""Exact RL resume (issue 23, item 1 and 4): a run resumed from any checkpoint logs exactly the
metrics of the straight run and ends on exactly its weights — also when the steps after the
checkpoint train no sample, with LoRA, with a critic, with dynamic sampling and with a model
reward's running normalisation.

A kill is simulated by copying the straight run's directory and removing what came after the
checkpoint (later checkpoints and ``final/``); the copy then runs with ``resume=auto`` in a fresh
``OnlineRL`` (new model, new optimizer: nothing carried over in memory)."""

from __future__ import annotations

import shutil

import pytest
import torch

from posttrain.run.checkpoint import checkpoint_root
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

from .resume_cases import overrides, rows_with_dead_steps, running_vowels, write_rows

pytestmark = pytest.mark.slow
STEPS = 6
DEAD = {3, 4}  # the steps right after the checkpoint at step 2 train no sample

NO_KL = ["algorithm.kl.placement=none", "algorithm.kl.coef=0"]  # a KL term would train every sample
CASES = {
    "grpo": ["algorithm=grpo", *NO_KL],
    "grpo_lora": ["algorithm=grpo", *NO_KL, "model.lora.r=4", "model.lora.alpha=8", "learning_rate=5e-2"],
    "ppo_critic": ["algorithm=ppo", "ppo_epochs=2", "minibatch_size=8"],
    # the light critic: its adapters and head over the policy's base (models/adapter_critic.py)
    "ppo_lora_light_critic": [
        *["algorithm=ppo", "ppo_epochs=2", "minibatch_size=8"],
        *["model.lora.r=4", "model.lora.alpha=8", "learning_rate=5e-2"],
    ],
    "dapo_dynamic_sampling": ["algorithm=dapo", "algorithm.overlong.enabled=false"],
    "stateful_reward": ["algorithm=rloo", "rewards=[tests.train.resume_cases:running_vowels]"],
    # asynchronous: the checkpoint holds the batches made ahead of the learner (sources/async_producer.py)
    "grpo_async": ["algorithm=grpo", *NO_KL, "rollout.max_staleness=2"],
    "areal_async_lora": ["algorithm=areal", "rollout.max_staleness=1", "model.lora.r=4", "model.lora.alpha=8"],
    "ppo_critic_async": ["algorithm=ppo", "ppo_epochs=2", "minibatch_size=8", "rollout.max_staleness=3"],
}


def comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in history]


def resume_from(straight_dir, resumed_dir, step: int, config_overrides: list[str]):
    shutil.copytree(straight_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "final")
    for path in checkpoint_root(resumed_dir).iterdir():
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    running_vowels.__init__()  # a fresh process would start with fresh module state
    config = load_rl_config(None, [*config_overrides, f"output_dir={resumed_dir}", "resume=auto"])
    run = OnlineRL(config, echo=lambda line: None)
    return run, run.run()


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_equals_the_straight_run_bitwise(tmp_path, case):
    data = write_rows(tmp_path / "rows.jsonl", rows_with_dead_steps(DEAD, STEPS))
    common = overrides(data, tmp_path / "straight", STEPS, [*CASES[case], f"keep_last={STEPS}"])
    running_vowels.__init__()
    straight_run = OnlineRL(load_rl_config(None, common), echo=lambda line: None)
    straight = straight_run.run()
    if case.startswith("grpo"):  # a critic trains every sample; dynamic sampling draws more prompts
        assert [h["train/active_fraction"] for h in straight][2:4] == [0.0, 0.0]
        assert straight[1]["train/active_fraction"] > 0  # gradients exist before the dead steps
    final = {k: v.clone() for k, v in straight_run.policy.state_dict().items()}
    for step in (2, 3):
        run, resumed = resume_from(tmp_path / "straight", tmp_path / f"resumed-{step}", step, common)
        assert [h["step"] for h in resumed] == list(range(step + 1, STEPS + 1))
        assert comparable(resumed) == comparable(straight[step:]), f"resumed from step {step}"
        state = run.policy.state_dict()
        assert all(torch.equal(state[k], final[k]) for k in final), f"weights after resuming from step {step}"


OFFLINE_TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "model.tiny.arch=llama"]
OFFLINE = {
    "sft": ["data.task=reverse", "data.n_train=64", "data.n_eval=9", "eval_size=0"],
    "rm": ["data.task=preference", "data.n_train=64", "data.n_eval=9"],
    "dpo": ["data.task=preference", "data.n_train=64", "data.n_eval=9"],
}


@pytest.mark.parametrize("command", list(OFFLINE))
def test_lora_runs_of_the_offline_commands_resume_exactly(tmp_path, command):
    from posttrain.cli import main
    from posttrain.telemetry.metrics import read_jsonl

    lora = ["model.lora.r=4", "model.lora.alpha=8", "learning_rate=1e-2", "batch_size=4", "log_every=100"]
    common = [*OFFLINE_TINY, *OFFLINE[command], *lora, "steps=6", "save_every=2", "keep_last=6"]
    assert main([command, *common, f"output_dir={tmp_path / 'straight'}"]) == 0
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "final")
    for step in (4, 6):
        shutil.rmtree(checkpoint_root(tmp_path / "resumed") / f"step-{step}")
    assert main([command, *common, f"output_dir={tmp_path / 'resumed'}", "--resume", "auto"]) == 0

    def records(name):
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]

    assert [r["step"] for r in records("resumed") if "lr" in r] == list(range(1, 7))
    assert records("resumed") == records("straight")
    straight = load_file_tensors(tmp_path / "straight" / "final" / "adapter")
    resumed = load_file_tensors(tmp_path / "resumed" / "final" / "adapter")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def load_file_tensors(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")
