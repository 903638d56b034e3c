"""Checks that turn silent RL failures into messages a person can act on.

* :func:`preflight_rewards` runs once, on the first sampled batch, before any update: a reward
  function that raises, returns None/NaN for every sample, or gives every sample the same
  value would otherwise train on zero advantages (or crash deep in the loop) without saying so.
* :class:`StepWarnings` looks at each step's metrics for the usual ways a run learns nothing:
  most completions truncated, most groups with zero reward variance, advantages all zero.
* :func:`check_before_loading`: what a user can get wrong that is checked before the policy loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from posttrain.config import ConfigError, dump_config
from posttrain.devices import resolve_device
from posttrain.distributed import join, note_strategy
from posttrain.envs import resolve_environment
from posttrain.errors import PosttrainError
from posttrain.models.packing import check_packable
from posttrain.models.section import check_model_source, vocab_size
from posttrain.run.run_dir import start_point
from posttrain.sources.recorded import check_replay_folder, run_shape
from posttrain.telemetry.metrics import check_report_to
from posttrain.train.rl_checkpoint import rl_state_fields
from posttrain.train.rl_config import RLRun
from posttrain.train.rl_sources import check_placement


class RewardPreflightError(PosttrainError, RuntimeError):
    """A reward function cannot drive learning on the first batch; the message shows why."""


def _show(text: Any, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def preflight_rewards(
    names: Sequence[str],
    components: Tensor,
    prompts: Sequence[Any],
    completions: Sequence[str],
    allow_constant: Sequence[str] = (),
    examples: int = 3,
) -> list[str]:
    """Raise :class:`RewardPreflightError` for a reward that cannot teach anything.

    ``components [B, K]`` holds each function's values (NaN for None). Returns notes for
    functions allowed to be constant. Rewards listed in ``allow_constant`` may be constant.
    """
    notes: list[str] = []
    problems: list[str] = []
    for k, name in enumerate(names):
        column = components[:, k]
        present = column[~column.isnan()]
        shown = "\n".join(
            f"      prompt {_show(prompts[i])}\n      completion {_show(completions[i])} -> "
            f"{'None' if math.isnan(float(column[i])) else f'{float(column[i]):g}'}"
            for i in range(min(examples, len(completions)))
        )
        if present.numel() == 0:
            problems.append(
                f"reward {name!r} returned None (or NaN) for all {len(column)} samples of the first batch: "
                f"it applies to none of these prompts. Check the dataset columns it needs and its parsing.\n{shown}"
            )
        elif bool((present == present[0]).all()):
            value = float(present[0])
            if name in allow_constant:
                notes.append(f"reward {name!r} gives every sample {value:g} on the first batch (allowed)")
                continue
            problems.append(
                f"reward {name!r} gives every one of {present.numel()} samples the same value {value:g}, so "
                f"every advantage would be 0 and nothing would be learned. If that is expected at the start "
                f"(e.g. a format no sample meets yet), add it to allow_constant_reward: [{name}]; otherwise "
                f"check the function.\n{shown}"
            )
    if problems:
        raise RewardPreflightError("pre-flight check of the reward functions failed:\n  - " + "\n  - ".join(problems))
    return notes


class StepWarnings:
    """Actionable warnings about a step's metrics, each repeated at most every ``every`` steps."""

    TRUNCATED_SHARE = 0.5
    ZERO_VARIANCE_SHARE = 0.8
    LEARNED_SHARE = 0.75

    def __init__(self, echo: Callable[[str], None], *, max_new_tokens: int, every: int = 50) -> None:
        self.echo, self.max_new_tokens, self.every = echo, max_new_tokens, every
        self._last: dict[str, int] = {}

    def _warn(self, key: str, step: int, message: str) -> None:
        if step - self._last.get(key, -self.every) >= self.every:
            self._last[key] = step
            self.echo(f"[warning] step {step}: {message}")

    def check(self, step: int, metrics: Mapping[str, float], *, group_estimator: bool) -> None:
        truncated = metrics.get("response/truncated_fraction", 0.0)
        if truncated > self.TRUNCATED_SHARE:
            self._warn(
                "truncated",
                step,
                f"{100 * truncated:.0f}% of completions hit max_new_tokens={self.max_new_tokens}; their reward "
                "reflects an unfinished answer. Raise max_new_tokens, or set algorithm.mask_truncated=true.",
            )
        zero = metrics.get("reward/zero_variance_group_fraction", 0.0)
        # groups that all reached the best reward are prompts the policy has learned: success
        learned = metrics.get("reward/zero_variance_at_max_fraction", 0.0) >= self.LEARNED_SHARE
        # with dynamic sampling on, the draw's flat groups were replaced; the source warns itself
        # when too few groups with signal were found ("raise algorithm.dynamic_sampling.max_rounds")
        resampled = "dynamic_sampling/kept_groups" in metrics
        if group_estimator and zero > self.ZERO_VARIANCE_SHARE and not learned and not resampled:
            self._warn(
                "zero_variance",
                step,
                f"{100 * zero:.0f}% of groups gave all their samples the same reward, so their advantages "
                "are 0. The task is too easy or too hard for the policy: raise samples_per_prompt, "
                "enable algorithm.dynamic_sampling, or start from a better SFT model.",
            )
        if metrics.get("tools/episodes_with_a_call") == 0.0:
            self._warn(
                "no_tool_call",
                step,
                "no episode called a tool: every answer came without one. Check env.options.format against the "
                "model's chat template and that the prompt says the tools exist (the template's tools section).",
            )
        if metrics.get("advantage/abs_max", 1.0) == 0.0 and not learned:
            self._warn(
                "zero_advantage",
                step,
                "every advantage is 0 this step, so the policy loss is 0 by construction and the "
                "weights only move through KL/entropy terms.",
            )


def check_before_loading(config: RLRun, *, model_given: bool) -> None:
    """What a user can get wrong and can be checked before the policy loads (the data and the
    rewards follow, still before it): the run folder and resume point (run_dir.py), the metric
    sinks, the device, the model folder, a recording to replay."""
    ranks = join(resolve_device(config.device))  # torchrun's process group, when started by it
    ranks.same_everywhere(config.micro_batch_tokens, "micro_batch_tokens")
    ranks.share(range(config.prompts_per_step), "prompts_per_step")  # whole groups per rank, or refused
    note_strategy(config.strategy)
    check_placement(config, ranks.device(resolve_device(config.device)))
    check_settings(config, model_given=model_given)


def check_settings(config: RLRun, *, model_given: bool = False) -> None:
    """The checks that read no data and need no process group, in the order a run makes them (the
    memory plan makes them too before it reads the data, so a run's first error is the same with or
    without it): the run folder and resume point, the metric sinks, the model folder, a recording
    to replay, the environment."""
    fields = rl_state_fields(config)
    start_point(config.output_dir, config.resume, config.overwrite, dump_config(config), config.steps, fields)
    check_report_to(config.report_to)
    if not model_given:
        check_model_source(config.model)
        if config.padding_free:
            check_packable(config.model.path, "padding_free")
    if config.rollout.replay is not None:
        masks = config.rollout.keep_sampling_mask
        check_replay_folder(config.rollout.replay, config.steps, run_shape(config), sampling_masks=masks)
    if config.env is not None:  # the class is imported and its options checked here
        resolve_environment(config.env.name, config.env.options)
    check_critic_folder(config)


def check_critic_folder(config: RLRun) -> None:
    """``algorithm.critic.init_from``: a model folder whose vocabulary is the policy's (the critic
    reads the policy's token ids)."""
    critic = config.algorithm.critic
    if critic is None or critic.init_from is None:
        return
    from posttrain.models.loading import check_model_folder, read_config

    folder = check_model_folder(critic.init_from)
    theirs, ours = read_config(folder).vocab_size, vocab_size(config.model)
    if theirs != ours:
        raise ConfigError(
            f"algorithm.critic.init_from = {critic.init_from!r} has a vocabulary of {theirs} tokens and the "
            f"policy one of {ours}: the critic reads the policy's token ids, so start it from a reward model "
            "trained on the policy's own base model (or leave init_from unset)"
        )
