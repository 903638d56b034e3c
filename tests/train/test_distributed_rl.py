"""``torchrun --nproc_per_node 2 -m posttrain rl`` on the CPU (gloo): the ranks generate and score
their shares of each step's groups, gather them for batch preparation, update with their shares
of every minibatch and sum the gradients — so replaying one process's recorded batches on two
ranks repeats its losses and gradient norms (within float summation order); the run resumes on
every rank, the critic's and the reward's state included; rank 0 alone writes the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_distributed import posttrain, resume_from_step

pytestmark = pytest.mark.slow

RL = ["rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
      "data.n_train=32", "data.n_eval=9", "eval_size=0", "prompts_per_step=4", "samples_per_prompt=4",
      "max_new_tokens=8", "learning_rate=1e-3", "device=cpu", "report_to=[]", "reward_workers=0",
      "rewards=[tests.train.test_rl:vowel_share]"]  # fmt: skip
RUNS = {
    # two epochs of two minibatches (one group per rank each), micro-batches, the KL in the loss
    "grpo": [
        *["ppo_epochs=2", "minibatch_size=8", "micro_batch_size=2"],
        *["algorithm.kl.placement=loss", "algorithm.kl.estimator=k3", "algorithm.kl.coef=0.05"],
    ],
    # a critic, GAE's batch whitening and the adaptive KL controller in the reward: whole-batch statistics
    "ppo": ["algorithm=ppo", "minibatch_size=8", "algorithm.kl.controller=adaptive"],
    # REINFORCE++: global batch normalisation of the advantages
    "reinforce_pp": ["algorithm=reinforce_pp"],
}


def steps(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "policy/grad_norm" in record]


@pytest.mark.parametrize(
    ("algorithm", "strategy"), [(name, "ddp") for name in sorted(RUNS)] + [("grpo", "fsdp2"), ("ppo", "fsdp2")]
)
def test_two_ranks_replaying_a_recording_repeat_the_one_process_run(tmp_path, algorithm, strategy):
    """ddp, and fsdp2: policy, reference and critic sharded, every pass of theirs a collective."""
    args = [*RL, *RUNS[algorithm], "steps=5", f"strategy={strategy}"]
    one = posttrain([*args, "record_rollouts=true", f"output_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = posttrain([*args, f"rollout.replay={tmp_path / 'one' / 'rollouts'}", f"output_dir={tmp_path / 'two'}"], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    sharded = two.stdout.count("sharded over 2 processes")  # the policy, the KL's reference, PPO's critic
    assert sharded == (0 if strategy == "ddp" else {"grpo": 2, "ppo": 3, "reinforce_pp": 1}[algorithm])

    single, pair = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert [r["step"] for r in pair] == [1, 2, 3, 4, 5]  # logged once, by rank 0
    compared = [key for key in single[0] if key.startswith("loss/")] + ["policy/grad_norm"]
    assert "loss/policy" in compared and ("loss/value" in compared) == (algorithm == "ppo")
    for a, b in zip(single, pair, strict=True):
        for key in compared:
            assert abs(a[key] - b[key]) < 1e-6, (a["step"], key, a[key], b[key])
        assert a["advantage/std"] == pytest.approx(b["advantage/std"], abs=1e-6)  # whole-batch statistics
    assert all(r["policy/grad_norm"] > 1e-3 for r in single)  # it trained (REINFORCE++'s loss is 0 on-policy)
    final_one = load_file(str(next((tmp_path / "one" / "final").glob("*.safetensors"))))
    final_two = load_file(str(next((tmp_path / "two" / "final").glob("*.safetensors"))))
    for name, tensor in final_one.items():
        torch.testing.assert_close(final_two[name], tensor, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_generating_ranks_resume_from_rank_0s_checkpoint(tmp_path, strategy):
    """Each rank samples its own groups (a stream of its own; under fsdp2 with a whole copy of the
    policy gathered after every update); a resumed two-rank PPO run — a critic, the adaptive KL,
    the data order, sharded optimizer states — continues the straight one exactly."""
    args = [*RL, *RUNS["ppo"], "steps=4", "save_every=2", "keep_last=5", "record_rollouts=true", f"strategy={strategy}"]
    straight = posttrain([*args, f"output_dir={tmp_path / 'straight'}"], ranks=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    recorded = load_file(str(tmp_path / "straight" / "rollouts" / "step-000001.safetensors"))
    assert recorded["group_ids"].tolist() == [g for g in range(4) for _ in range(4)]  # both shares, in order
    completions = json.loads((tmp_path / "straight" / "rollouts" / "step-000001.json").read_text())["completions"]
    assert completions[:8] != completions[8:]  # the ranks sampled different prompts, each its own way

    resumed_dir = tmp_path / "resumed"
    resumed = resume_from_step(args, tmp_path / "straight", resumed_dir, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[resume] step 2" in resumed.stdout

    def trained(run_dir):
        return [{k: v for k, v in r.items() if k.startswith(("loss/", "policy/", "reward/", "kl/"))}
                for r in steps(run_dir)]  # fmt: skip

    assert trained(resumed_dir)[2:] == trained(tmp_path / "straight")[2:]
    assert any(r["loss/value"] > 0 for r in steps(resumed_dir))


def test_a_step_the_ranks_cannot_split_into_whole_groups_is_refused_before_loading(tmp_path):
    result = posttrain([*RL, "prompts_per_step=3", "steps=1", f"output_dir={tmp_path / 'odd'}"], ranks=2)
    assert result.returncode != 0
    # the ranks' message (a rank torchrun stops first may not have printed), and torchrun's root cause
    message = "posttrain rl: prompts_per_step (3) must be a multiple of the number of processes"
    assert any(line.startswith(message) for line in result.stderr.splitlines())
    assert f"traceback : {message}" in result.stderr
    assert not (tmp_path / "odd").exists()


# Runs ``posttrain.cli.main`` on each rank, then reports whether the world process group still
# exists once main has returned, i.e. before the interpreter's finalization.
OUTLIVES = """
import os, sys, weakref
import torch.distributed as dist
import posttrain.distributed
from posttrain.cli import main

left = []
leave = posttrain.distributed.leave
def watched_leave():
    if dist.is_initialized():
        left.append(weakref.ref(dist.distributed_c10d._get_default_group()))
    leave()
posttrain.distributed.leave = watched_leave
code = main()
outlives = any(ref() is not None for ref in left)
with open(f"{sys.argv[-1].split('=', 1)[1]}.rank{os.environ['RANK']}", "w") as report:
    report.write(f"left its group: {bool(left)}; the group outlives main: {outlives}")
sys.exit(code)
"""


def test_an_fsdp2_rank_frees_its_process_group_before_the_interpreter_exits(tmp_path):
    """What held it after destroy_process_group: FSDP2's modules in reference cycles, and torch's
    caches of DTensor plans keeping their device meshes, which keep their groups. A group freed
    only in the interpreter's finalization has gloo's threads running there, a way for a rank to
    abort at exit ("terminate called without an active exception") after a finished run."""
    script = tmp_path / "outlives.py"
    script.write_text(OUTLIVES)
    args = [*RL, *RUNS["grpo"], "steps=1", "strategy=fsdp2", f"output_dir={tmp_path / 'run'}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run([*launcher, str(script), *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [(tmp_path / f"run.rank{rank}").read_text() for rank in (0, 1)]
    assert said == ["left its group: True; the group outlives main: False"] * 2
