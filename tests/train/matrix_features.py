"""The features of the combination matrix (tests/train/test_combination_matrix.py): each one's
overrides and the check that it took effect in a short run, over one data set whose effect is
visible — a "flat" row always scores 1 (a group without spread, a prompt always passed), a "coin"
row scores a coin flip of the answer; single-turn through :func:`flat_or_coin`, multi-turn
through ``data_side_envs.FlatOrCoin``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.algos import overlong_reward_penalty
from posttrain.distributed import is_sharded, world
from posttrain.sources.recorded import read_batch

ENV = "tests.sources.data_side_envs:FlatOrCoin"
STEPS = 2


def flat_or_coin(prompts, completions, completion_ids, kind, **columns):
    """1 for a flat row; for a coin row the parity of the completion's token ids' sum (a fair coin
    for a random policy: its completions mostly run to the same length)."""
    return [1.0 if k == "flat" else float(sum(ids) % 2) for k, ids in zip(kind, completion_ids, strict=True)]


def write_rows(path: Path) -> Path:
    """Flat and coin rows at both curriculum levels (the filter keeps coin rows of each)."""
    rows = [{"prompt": f"{kind}:", "kind": kind, "level": level} for level in (0, 1) for kind in ("flat", "coin")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * 6), encoding="utf-8")
    return path


def base_overrides(data: Path, out: Path) -> list[str]:
    return [
        *["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", f"data.path={data}"],
        *["max_new_tokens=5", "prompts_per_step=2", "samples_per_prompt=4", "eval_size=0", f"steps={STEPS}"],
        *["reward_workers=0", "log_every=100", "learning_rate=1e-3"],
        "rewards=[tests.train.matrix_features:flat_or_coin]",
        "allow_constant_reward=[flat_or_coin]",  # a step may draw flat rows alone: no spread, by design
        f"output_dir={out}",
    ]  # fmt: skip


@dataclass
class Trace:
    """What a finished run left to check: the run, its history, the batches it trained on and the
    weights (by name) the policy and the critic started from."""

    run: Any
    history: list[dict[str, float]]
    batches: list[Any]
    out: Path
    policy_start: dict[str, torch.Tensor] = field(default_factory=dict)
    critic_start: dict[str, torch.Tensor] = field(default_factory=dict)
    ray_generations: int = 0
    vllm_generations: int = 0


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (its FSDP2 shard), detached and copied."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def _env(trace: Trace) -> None:
    assert all("env/turns_mean" in h for h in trace.history)
    assert any(h["env/turns_mean"] > 1 for h in trace.history)  # coin rows ask twice


def _asynchronous(trace: Trace) -> None:
    assert [h["async/staleness_max"] for h in trace.history] == [0.0, 1.0][: len(trace.history)]


def _interrupt(trace: Trace) -> None:
    assert all(h["async/staleness_max"] <= 1 for h in trace.history)  # starts with the newest weights held
    assert all(batch.token_versions is not None for batch in trace.batches)  # each token's version tracked


def _lora(trace: Trace) -> None:
    now = {name: local(p) for name, p in trace.run.policy.named_parameters()}
    changed = {name for name, before in trace.policy_start.items() if not torch.equal(now[name], before)}
    assert changed and all("lora_" in name for name in changed), sorted(changed)[:5]


def _critic(trace: Trace) -> None:
    assert all("loss/value" in h for h in trace.history)
    now = {name: local(p) for name, p in trace.run.critic.named_parameters()}
    assert any(not torch.equal(now[name], before) for name, before in trace.critic_start.items())


def _dynamic_sampling(trace: Trace) -> None:
    assert all(h["dynamic_sampling/kept_groups"] == 2 for h in trace.history)
    for batch in trace.batches:
        for group in batch.group_ids.unique():
            assert batch.scores[batch.group_ids == group].std() > 0  # only groups with spread are trained


def _overlong(trace: Trace) -> None:
    shaped = False
    for batch in trace.batches:
        lengths = batch.response_mask.sum(-1)
        penalty = overlong_reward_penalty(lengths, 6, 4)
        raw = batch.scores - penalty
        assert torch.all((raw >= -1e-6) & (raw <= 1 + 1e-6))  # the rewards are in [0, 1]; the shaping shifts them
        shaped |= bool((penalty < 0).any())
    assert shaped


def _filter(trace: Trace) -> None:
    rates, kept = trace.run.data_filter.rates, trace.run.data_filter.kept
    assert kept and all(rates[i] < 1 for i in kept) and 1.0 in rates  # flat rows always pass: dropped
    assert all(set(batch.columns["kind"]) == {"coin"} for batch in trace.batches)


def _curriculum(trace: Trace) -> None:
    assert all("curriculum/level" in h for h in trace.history)
    assert trace.history[0]["curriculum/level"] == 0  # the first draw is of the easiest level
    assert 0 in trace.batches[0].columns["level"]


def _record(trace: Trace) -> None:
    """The recording holds each step's batch (under torchrun the ranks' shares, together: this
    rank's share is its groups, as a replay splits them)."""
    ranks = world()
    for step, batch in enumerate(trace.batches, start=1):
        recorded, _ = read_batch(trace.out / "rollouts", step)
        assert len(recorded) == ranks.size * len(batch)
        mine = torch.tensor(ranks.split(recorded.group_ids.unique().tolist()))
        share = recorded.select(torch.nonzero(torch.isin(recorded.group_ids, mine)).flatten())
        width = batch.response_ids.shape[1]  # the whole is padded to the widest share
        assert torch.equal(share.response_ids[:, :width], batch.response_ids)
        assert not share.response_mask[:, width:].any()


def _fsdp2(trace: Trace) -> None:
    assert world().size == 2 and is_sharded(trace.run.policy)  # two ranks, each holding a shard


def _ray(trace: Trace) -> None:
    # every batch drawn by the Ray rollout workers (dynamic sampling may draw more than once)
    assert trace.ray_generations >= len(trace.history) == STEPS


def _replay(trace: Trace) -> None:
    pass  # checked by the matrix test: the replayed run repeats the recorded one's losses


@dataclass(frozen=True)
class Feature:
    overrides: list[str]
    check: Callable[[Trace], None]


FEATURES: dict[str, Feature] = {
    "env": Feature([f"env.name={ENV}", "env.max_turns=3", "rewards=[]", "allow_constant_reward=[]"], _env),
    "max_staleness": Feature(["rollout.max_staleness=1"], _asynchronous),
    # the CPU's default producer (a process) pairs with max_staleness, the GPU's (a thread) with interrupt
    "interrupt": Feature(["rollout.max_staleness=1", "rollout.interrupt=true", "rollout.producer=thread"], _interrupt),
    "lora": Feature(["model.lora.r=4", "model.lora.alpha=8"], _lora),
    "critic": Feature(["algorithm=ppo"], _critic),
    "dynamic_sampling": Feature(
        ["algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=8"], _dynamic_sampling
    ),
    "overlong": Feature(
        ["algorithm.overlong.enabled=true", "algorithm.overlong.max_length=6", "algorithm.overlong.cache_length=4"],
        _overlong,
    ),
    "filter": Feature(["data.filter.pass_rate=[0.1, 0.9]", "data.filter.k=4"], _filter),
    "curriculum": Feature(
        ["data.curriculum.column=level", "data.curriculum.levels=[0, 1]", "data.curriculum.window=1"], _curriculum
    ),
    "record_rollouts": Feature(["record_rollouts=true"], _record),
    # the two below run in other processes: the Ray cluster's workers; two torchrun ranks
    "ray": Feature(["cluster.kind=ray", "cluster.rollout_workers=1"], _ray),
    "fsdp2": Feature(["strategy=fsdp2"], _fsdp2),
    "replay": Feature([], _replay),  # rollout.replay=<a recording of the same pair>, set by the test
}


def _vllm(trace: Trace) -> None:
    if trace.run.config.cluster.kind == "ray":  # each worker's engine: built there from the config's kind
        assert trace.ray_generations >= STEPS and trace.run.config.engine_kind == "vllm"
    else:
        assert trace.vllm_generations >= STEPS  # every batch drawn by a VLLMEngine of this process
    if not trace.run.config.rollout.max_staleness:  # sampled by the weights the learner scores with:
        # vLLM took every update (the second step would be off by a whole update otherwise)
        # (a step whose rewards are all flat skips the update, and with it the metric)
        gaps = [h["policy/engine_logprob_gap"] for h in trace.history if "policy/engine_logprob_gap" in h]
        assert all(gap < 1e-4 for gap in gaps), gaps


# paired with every feature above in test_vllm_matrix.py (run in .venv-vllm), not in the main matrix.
# Head dim 32 (64 / 2): vLLM's CPU attention takes head sizes from 32 up; the producer in a thread,
# whose engine this process can watch (the rollout process's vLLM is tested in test_rl_vllm.py)
VLLM = Feature(["rollout.engine=vllm", "model.tiny.hidden=64", "rollout.vllm.max_model_len=64",
                "rollout.producer=thread"], _vllm)  # fmt: skip
