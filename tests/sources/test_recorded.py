"""record_rollouts and rollout.replay: a recorded run fed back through the update repeats its
losses and gradient norms exactly, with no engine and no reward called; recordings that cannot
be replayed are refused before a model loads."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.sources.recorded import SCHEMA_VERSION, RecordingError, read_batch, recorded_steps
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from tests.train.test_rl import SMALL, TINY, vowel_share

STEPS = 10
RUNS = {
    "grpo": ["algorithm=grpo", "ppo_epochs=2", "algorithm.kl.placement=loss", "algorithm.kl.coef=0.05"],
    "ppo": ["algorithm=ppo", "minibatch_size=8"],
}
REPEATED = ("loss/", "policy/", "advantage/", "kl/", "value/", "critic/", "reward/", "response/")


def exploding_reward(prompts, completions, completion_ids, **columns):
    raise AssertionError("a replayed run called a reward function")


def build(tmp_path, name, overrides, rewards=(vowel_share,)):
    config = load_rl_config(None, [*TINY, *SMALL, f"steps={STEPS}", f"output_dir={tmp_path / name}", *overrides])
    return OnlineRL(config, reward_functions=list(rewards), echo=lambda line: None)


def repeated(history):
    return [{k: v for k, v in m.items() if k.startswith(REPEATED)} for m in history]


@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_a_replayed_run_repeats_the_recorded_losses_exactly(tmp_path, algorithm):
    recorded_run = build(tmp_path, "recorded", [*RUNS[algorithm], "record_rollouts=true"])
    recorded = recorded_run.run()
    folder = tmp_path / "recorded" / "rollouts"
    assert recorded_steps(folder) == list(range(1, STEPS + 1))

    replay = build(tmp_path, "replay", [*RUNS[algorithm], f"rollout.replay={folder}"], rewards=(exploding_reward,))

    def no_engine(*args, **kwargs):
        raise AssertionError("a replayed run sampled")

    replay.engine.generate = no_engine
    replayed = replay.run()
    assert repeated(replayed) == repeated(recorded)  # to the bit
    assert any(m["policy/grad_norm"] > 0 for m in replayed) and "loss/policy" in replayed[0]
    if algorithm == "ppo":  # the critic's loss repeats too, and it trained
        assert any(m["loss/value"] > 0 for m in replayed) and "critic/explained_variance" in replayed[0]
    for name, tensor in recorded_run.policy.state_dict().items():
        assert torch.equal(tensor, replay.policy.state_dict()[name]), name


def test_a_recorded_step_holds_the_batch_the_loop_trained_on(tmp_path):
    run = build(tmp_path, "run", ["steps=2", "record_rollouts=true", "log_samples=16"])
    run.run()
    batch, metrics = read_batch(tmp_path / "run" / "rollouts", 2)
    samples = [s for s in read_jsonl(tmp_path / "run" / "samples.jsonl") if s["step"] == 2]
    # every sample of the step was logged (16 of 16), the best, worst and median first
    recorded = sorted(zip(batch.completions, batch.scores.tolist(), strict=True))
    logged = sorted((s["completion"], s["reward"]) for s in samples)
    assert [c for c, _ in recorded] == [c for c, _ in logged]
    assert [r for _, r in recorded] == pytest.approx([r for _, r in logged])
    assert batch.response_ids.dtype == torch.long and batch.truncated.dtype == torch.bool
    assert metrics["reward/mean"] == read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]["reward/mean"]


def test_recordings_that_cannot_be_replayed_are_refused_before_a_model_loads(tmp_path, monkeypatch):
    build(tmp_path, "run", ["steps=3", "record_rollouts=true"]).run()
    folder = tmp_path / "run" / "rollouts"
    import posttrain.train.rl

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the recording was checked")

    monkeypatch.setattr(posttrain.train.rl, "build_model_and_tokenizer", no_model)
    with pytest.raises(RecordingError, match=r"holds steps 1–3, not step 4 of the 5 asked for"):
        build(tmp_path, "a", ["steps=5", f"rollout.replay={folder}"])
    with pytest.raises(RecordingError, match=r"rollout.replay = '.*missing' is not a folder"):
        build(tmp_path, "b", [f"rollout.replay={tmp_path / 'missing'}"])
    first = folder / "step-000001.json"
    text = json.loads(first.read_text())
    first.write_text(json.dumps({**text, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(RecordingError, match=rf"schema version {SCHEMA_VERSION + 1}; this posttrain reads version"):
        build(tmp_path, "c", ["steps=3", f"rollout.replay={folder}"])


def test_a_replay_of_another_shape_or_model_is_refused_and_another_loss_is_not(tmp_path, monkeypatch):
    """Issue 45, item 4: a recording of samples_per_prompt=4 replayed under 2 without a word."""
    build(tmp_path, "run", ["steps=2", "record_rollouts=true"]).run()
    folder = tmp_path / "run" / "rollouts"
    replay = ["steps=2", f"rollout.replay={folder}"]
    for change, key in [
        ("samples_per_prompt=2", "samples_per_prompt: recorded 4, here 2"),
        ("prompts_per_step=2", "prompts_per_step: recorded"),
        ("model.tiny.hidden=64", "model: recorded"),
    ]:
        with pytest.raises(RecordingError, match=key):
            build(tmp_path, "x", [*replay, change])
    # an A/B of the update on the same batches: another estimator and loss replay fine
    history = build(tmp_path, "ab", [*replay, "algorithm=rloo"]).run()
    assert len(history) == 2


@pytest.mark.parametrize("damage", ["no prompts", "no tensor", "short column"])
def test_a_damaged_recording_is_refused_naming_the_file(tmp_path, damage):
    from safetensors.torch import load_file, save_file

    build(tmp_path, "run", ["steps=1", "record_rollouts=true"]).run()
    folder = tmp_path / "run" / "rollouts"
    text_path, tensor_path = folder / "step-000001.json", folder / "step-000001.safetensors"
    text, tensors = json.loads(text_path.read_text()), load_file(str(tensor_path))
    if damage == "no prompts":
        del text["prompts"]
    elif damage == "no tensor":
        del tensors["response_mask"]
    else:
        text["completions"] = text["completions"][:-1]
    text_path.write_text(json.dumps(text))
    save_file(tensors, str(tensor_path))
    expected = {"no prompts": "lacks \\['prompts'\\]", "no tensor": "lacks the tensors \\['response_mask'\\]",
                "short column": "completions holds"}[damage]  # fmt: skip
    with pytest.raises(RecordingError, match=expected):
        build(tmp_path, "replayed", ["steps=1", f"rollout.replay={folder}"])
