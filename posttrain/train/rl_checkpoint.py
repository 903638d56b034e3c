"""What an RL run's checkpoint holds, and how a run resumes from one (``train/rl.py``).

A step's checkpoint is the policy (``checkpoint.py``: a plain model folder, or a LoRA policy's
adapters) and a training state: the policy's optimizer and schedule, the KL coefficient, the
running baseline, every rank's rollout source (its rewards' running statistics), and the
critic with its optimizer. Under ``strategy: fsdp2`` every sharded part is gathered whole to
rank 0 first (every rank takes part), so a checkpoint never depends on how it was sharded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.run.checkpoint import load_training_state, load_weights_into, save_checkpoint, weights_to_save
from posttrain.run.checkpoint_checks import StateFields
from posttrain.run.run_outputs import on_main


def rl_state_fields(config: Any) -> StateFields:
    """What an RL checkpoint's state holds besides the step and RNG states, each of its type: checked
    before a resume touches anything (``run/checkpoint_checks.py``)."""
    fields: dict[str, type | tuple[type, ...]] = {"optimizer": dict, "scheduler": dict, "kl_coef": (int, float)}
    if config.algorithm.critic is not None:
        fields.update(critic=dict, critic_optimizer=dict)
    return fields


def save_rl_checkpoint(loop: Any, step: int, config_yaml: str | None = None) -> None:
    """Write ``loop``'s (an ``OnlineRL``) checkpoint of ``step``, by rank 0; every rank calls this."""
    ranks = loop.ranks
    state: dict[str, Any] = {
        "optimizer": ranks.optimizer_state(loop.policy, loop.optimizer),
        "scheduler": loop.scheduler.state_dict(),
        "kl_coef": loop.kl_controller.value,
        # each rank's source (its rewards' running state); the top level is rank 0's
        **ranks.merged_states(loop.source.state_dict()),
    }
    if loop.running_baseline is not None:
        state["running_baseline"] = loop.running_baseline.state_dict()
    if loop.critic is not None:
        critic_weights = ranks.full_weights(loop.critic)
        state["critic"] = loop.critic.state_dict() if critic_weights is None else critic_weights
        state["critic_optimizer"] = ranks.optimizer_state(loop.critic, loop.critic_optimizer)
    weights = weights_to_save(loop.policy)
    on_main(
        lambda: save_checkpoint(
            loop.out,
            step,
            model=loop.policy,
            tokenizer=loop.tokenizer,
            config_yaml=config_yaml,
            keep_last=loop.config.keep_last,
            training_state=state,
            weights=weights,
        )
    )


def resume_rl(loop: Any, path: Path | None) -> int:
    """Restore ``loop``'s every part from checkpoint ``path``; return its step (0 for a fresh start)."""
    if path is None:
        return 0
    load_weights_into(loop.policy, path)
    state = load_training_state(path, rl_state_fields(loop.config))
    loop.ranks.load_optimizer_state(loop.policy, loop.optimizer, state["optimizer"])
    loop.scheduler.load_state_dict(state["scheduler"])
    loop.kl_controller.value = float(state["kl_coef"])
    if loop.running_baseline is not None:
        loop.running_baseline.load_state_dict(state["running_baseline"])
    for name in loop.source.load_state_dict(loop.ranks.own_state(state)):
        loop.echo(
            f"[resume] {path} holds no state for {name} (saved by an older posttrain): its "
            "running statistics start again, so rewards after the resume differ from a straight run"
        )
    if loop.critic is not None:
        loop.ranks.load_weights(loop.critic, state["critic"])
        loop.ranks.load_optimizer_state(loop.critic, loop.critic_optimizer, state["critic_optimizer"])
    loop.source.sync_weights(int(state["step"]))
    loop.echo(f"[resume] step {state['step']} restored from {path}")
    return int(state["step"])
