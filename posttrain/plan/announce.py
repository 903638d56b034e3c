"""What a command does with its memory plan before any weights load: size its passes
(``micro_batch_budget.py``), print the plan, and refuse a run whose peak cannot fit, naming the key
to change (``posttrain rl|sft|rm|dpo ... --plan`` stops after it)."""

from __future__ import annotations

from typing import Any

from posttrain.config import ConfigError
from posttrain.devices import resolve_device
from posttrain.models.section import context_length
from posttrain.plan.memory_model import ShapeUnknown, plan_lines
from posttrain.plan.micro_batch_budget import budget_line, resolve_budget
from posttrain.plan.plan import check_fits, device_memory, make_plan, plan_inputs
from posttrain.run.out_of_memory import REMEDIES


def announce_plan(command: str, config: Any, *, echo: bool = True) -> Any:
    """The run's config with its micro-batch budget resolved (micro_batch_budget.py); prints the
    memory plan (``echo``: rank 0) and refuses a run whose peak cannot fit (``--plan`` stops here)."""
    where = resolve_device(config.device)
    _check_before_data(command, config)
    device, available = device_memory(where, config.memory_gib)
    try:
        inputs = plan_inputs(command, config)
    except ShapeUnknown as error:  # an architecture the formulas do not know: the run goes on unplanned
        if echo:
            print(
                f"[{command}] memory plan: not made, as model {config.model.path} cannot be sized ({error}); "
                "micro_batch_size or micro_batch_tokens bound the passes"
            )
        return config
    _check_room_to_generate(command, config)
    config, origin = resolve_budget(inputs, config, available, where.type == "cpu")
    plan = make_plan(inputs, config)
    if echo:
        sizing = budget_line(inputs, config, origin)
        lines = plan_lines(plan, device, available)
        print("\n".join([f"[{command}] memory plan (estimated from the shapes):", *lines, *filter(None, [sizing])]))
    stage = STAGE_OF_PHASE.get(plan.peak_phase.name, plan.peak_phase.name)
    check_fits(plan, device, available, REMEDIES.get(stage, "the batch sizes"))
    return config


def _check_room_to_generate(command: str, config: Any) -> None:
    """A generation limit the model's context cannot hold is the cause to name, before the memory
    it would take: every prompt would be refused."""
    if command != "rl":
        return
    context = context_length(config.model)
    if context is not None and config.max_new_tokens >= context:
        raise ConfigError(
            f"max_new_tokens = {config.max_new_tokens} leaves no room for a prompt in the model's context of {context} "
            f"tokens (max_position_embeddings): set it below {context}, with room for the longest prompt"
        )


def _check_before_data(command: str, config: Any) -> None:
    """What the run itself checks before it reads the data, so that its first error stays the
    same: the run folder, the metric sinks, the model folder (and, in RL, a recording, the environment)."""
    if command == "rl":
        from posttrain.train.rl_checks import check_settings

        check_settings(config)
    else:
        from posttrain.train.recipes import check_run_dir

        check_run_dir(config)


STAGE_OF_PHASE = {"values": "log-probs", "critic update": "update"}  # phases named as the run's stages
