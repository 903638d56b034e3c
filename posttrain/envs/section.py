"""The ``env:`` config section (docs/design.md, "Next": the environment contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from posttrain.config import Section


class EnvSection(Section):
    """A multi-turn environment: each sample is an episode of policy turns and environment
    answers (``posttrain/envs/``); the policy's turns are trained, the environment's tokens are
    context."""

    name: str
    """A built-in (support_bot, calculator, python) or ``pkg.module:Class`` imported from the
    working directory, as a reward function is."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = Field(8, ge=1)
    """Policy turns per episode; an episode still going after them is cut (env/truncated)."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Tokens per episode, prompt and every turn included (null: the model's context length);
    max_new_tokens still limits each turn."""
    discount: float = Field(1.0, gt=0, le=1)
    """γ per turn: turn k's reward counts γ^(k-1) (the estimators' own γ counts tokens)."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds one reset or step may take; longer is an episode error."""
    max_concurrent: int = Field(64, ge=1)
    """Environments reset or stepped at once (sync ones each in a thread, async ones on one
    event loop): a turn of slow tools takes about the slowest one's time, not the sum."""
    max_error_fraction: float = Field(0.5, ge=0, le=1)
    """Share of a batch's episodes that may end in an environment error (left out of the loss,
    never scored 0) before the run stops naming the first error."""
    max_malformed_fraction: float = Field(0.5, ge=0, le=1)
    """For environments that parse tool calls (``tools``): the share of the policy's turns (mean
    over a batch's episodes) whose call could not be read before the run stops showing three of
    them — a format that does not match the model's chat template fails loudly, not by training
    on error messages."""
    on_prefix_mismatch: Literal["error", "new_sample"] = "error"
    """When the chat template rewrites earlier turns (Qwen3's drops earlier ``<think>``
    blocks): ``error`` stops naming the turn and the differing tokens; ``new_sample`` goes on
    with the template's own rendering of the conversation as a new sample's prompt, as the
    model would see it deployed. The samples of one episode share its group and its return,
    so it needs a group estimator (grpo, rloo, ...), and an episode split in k samples weighs
    k times in its group's mean and deviation (each sample's tokens are trained once)."""
