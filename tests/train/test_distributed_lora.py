"""LoRA on FSDP2 ranks (``torchrun --nproc_per_node 2``, gloo on the CPU): the frozen base and the
adapters sharded alike, the adapters gathered for checkpoints and folded into ``final/`` — the run
equals one LoRA process within float summation order, for sft, rm, dpo and rl, and resumes exactly;
and an asynchronous producer (``rollout.max_staleness``) beside a sharded learner samples each
batch with exactly the weights of its admitted version (distributed.py, checkpoint.py,
sources/async_producer.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from posttrain.models.logprobs import response_logprobs
from posttrain.models.section import build_model_and_tokenizer
from posttrain.run.checkpoint import load_weights_into
from posttrain.sources.recorded import read_batch
from posttrain.train.rl_config import RLRun, load_rl_config
from tests.train.test_distributed import COMMANDS, COMMON, LOSS, metrics, posttrain, resume_from_step
from tests.train.test_distributed_rl import RL, RUNS, steps

pytestmark = pytest.mark.slow

LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def same_folder(a, b, atol: float = 1e-5) -> None:
    """Every safetensors file under ``a`` (final/ and final/adapter/) equal to ``b``'s, by name."""
    files = sorted(path.relative_to(a) for path in a.rglob("*.safetensors"))
    assert files == sorted(path.relative_to(b) for path in b.rglob("*.safetensors")) and files
    for name in files:
        one, two = load_file(str(a / name)), load_file(str(b / name))
        assert one.keys() == two.keys(), name
        for key, tensor in one.items():
            torch.testing.assert_close(two[key], tensor, atol=atol, rtol=0)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_lora_on_two_fsdp2_ranks_equals_one_lora_process(tmp_path, command):
    """Losses and gradient norms within 1e-6 over 5 steps; final/ (adapters folded in: a plain
    folder) and final/adapter/ equal; sft's run resumes from rank 0's checkpoint exactly."""
    args = [command, *COMMON, *COMMANDS[command], *LORA, "save_every=2", "keep_last=5"]
    one = posttrain([*args, f"output_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = posttrain([*args, "strategy=fsdp2", f"output_dir={tmp_path / 'two'}"], ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "ForCausalLM sharded over 2 processes" in two.stdout or "ForSequenceClassification sharded" in two.stdout
    single, pair = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len({round(r[LOSS[command]], 6) for r in single}) > 1  # it trained
    for a, b in zip(single, pair, strict=True):
        assert abs(a[LOSS[command]] - b[LOSS[command]]) < 1e-6, (a["step"], a[LOSS[command]], b[LOSS[command]])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-6, (a["step"], a["grad_norm"], b["grad_norm"])
    same_folder(tmp_path / "one" / "final", tmp_path / "two" / "final")
    # a checkpoint holds the adapters (and a reward model's head) alone, gathered from the shards
    saved = load_file(str(tmp_path / "two" / "checkpoints" / "step-2" / "adapter_model.safetensors"))
    assert saved and all("lora_" in name or "score" in name for name in saved)
    if command == "sft":
        args = [*args, "strategy=fsdp2"]
        resumed = resume_from_step(args, tmp_path / "two", tmp_path / "resumed", 2)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "[resume] step 2" in resumed.stdout
        assert metrics(tmp_path / "resumed")[2:] == pair[2:]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_lora_rl_on_two_fsdp2_ranks_replays_one_process_and_resumes(tmp_path, algorithm):
    """GRPO with the KL in the loss (the reference is the policy with its adapters off), and PPO
    with the light critic (its adapters and head over the sharded base, whole on every rank),
    replaying one LoRA process's recorded batches on two fsdp2 ranks: losses and gradient norms
    within 1e-6, final/ equal; resumed from rank 0's checkpoint, the rest repeats exactly."""
    args = [*RL, *RUNS[algorithm], *LORA, "steps=5", "save_every=2", "keep_last=5"]
    one = posttrain([*args, "record_rollouts=true", f"output_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    replay = [*args, "strategy=fsdp2", f"rollout.replay={tmp_path / 'one' / 'rollouts'}"]
    two = posttrain([*replay, f"output_dir={tmp_path / 'two'}"], ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (
        two.stdout.count("sharded over 2 processes") == 1
    )  # the policy: no reference copy with LoRA; a light critic stays whole
    single, pair = steps(tmp_path / "one"), steps(tmp_path / "two")
    for a, b in zip(single, pair, strict=True):
        for key in ("loss/policy", "loss/kl" if algorithm == "grpo" else "loss/value", "policy/grad_norm"):
            assert abs(a[key] - b[key]) < 1e-6, (a["step"], key, a[key], b[key])
    assert all(r["policy/grad_norm"] > 1e-3 for r in single)
    same_folder(tmp_path / "one" / "final", tmp_path / "two" / "final")
    resumed = resume_from_step(replay, tmp_path / "two", tmp_path / "resumed", 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[resume] step 2" in resumed.stdout
    assert trained(tmp_path / "resumed")[2:] == trained(tmp_path / "two")[2:]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_asynchronous_producer_beside_fsdp2_ranks_samples_with_its_admitted_version(tmp_path, lora):
    """max_staleness 1 under fsdp2: each rank's producer takes the learner's trainable weights
    gathered whole after every update. Batch k samples with version k − 2: its engine log-probs
    equal the trainer's forward of checkpoint step-(k − 2) within fp32 noise, and differ from
    the version before it (so the check can fail)."""
    overrides = [*RL, "steps=5", "save_every=1", "keep_last=10", "rollout.max_staleness=1", "record_rollouts=true"]
    overrides += LORA if lora else []
    run = posttrain([*overrides, "strategy=fsdp2", f"output_dir={tmp_path / 'run'}"], ranks=2)
    assert run.returncode == 0, run.stderr[-3000:]
    records = steps(tmp_path / "run")
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 1.0, 1.0]  # within η, and used
    config = load_rl_config(overrides=[o for o in overrides[1:] if not o.startswith("rewards=")])
    for step in (4, 5):
        batch, _ = read_batch(tmp_path / "run" / "rollouts", step)
        assert batch.policy_version.tolist() == [step - 2] * len(batch.policy_version)
        gaps = [logprob_gap(config, tmp_path / "run", batch, version) for version in (step - 2, step - 3)]
        assert gaps[0] < 1e-4 < 10 * 1e-4 < gaps[1], (step, gaps)


def trained(run_dir) -> list[dict]:
    """The logged steps without wall times and throughput."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in steps(run_dir)]


def logprob_gap(config: RLRun, run_dir, batch, version: int) -> float:
    """Largest |engine log-prob − log π_version| over the batch's sampled tokens, π_version being
    checkpoint step-``version`` of ``run_dir`` loaded into a model built as the run built it."""
    model, _ = build_model_and_tokenizer(config.model, config.seed)
    load_weights_into(model, run_dir / "checkpoints" / f"step-{version}")
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask.long()], dim=1)
    with torch.no_grad():
        logprobs, _ = response_logprobs(model.eval(), ids, mask, batch.prompt_ids.shape[1])
    sampled = batch.response_mask.bool()
    return float((logprobs - batch.engine_logprobs)[sampled].abs().max())
