"""The lines every training command opens with: what runs, on which model and data, how big a step
is, on which device, and where its files go. Made from the resolved config before anything
loads, so a wrong guess ("this was meant for the GPU") is seen in the first second."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.devices import resolve_device


def run_header(command: str, config: Any, notes: Sequence[str] = ()) -> list[str]:
    """The header of ``posttrain COMMAND`` for its resolved ``config`` (RLRun, SFTRun, ...), and
    ``notes`` on how it was resolved (a preset replacing the file's algorithm section)."""
    what = f"posttrain {command}"
    if command == "rl":
        algorithm = config.algorithm
        what += f": {algorithm.preset or 'algorithm'} (advantage {algorithm.advantage}, "
        what += f"loss {algorithm.policy_loss}, KL {algorithm.kl.placement})"
    lines = [what, f"  model   {describe_model(config.model)}"]
    data = describe_data(config)
    if data:
        lines.append(f"  data    {data}")
    lines += [
        f"  step    {describe_step(command, config)}; {config.steps} steps",
        f"  device  {describe_device(config)}",
        f"  output  {config.output_dir}",
    ]
    return lines + [f"  note    {note}" for note in notes]


def describe_model(model: Any) -> str:
    if model.path is not None:
        text = model.path
    elif model.tiny is not None:
        tiny = model.tiny
        text = f"a tiny {tiny.arch} built here ({tiny.layers} layers × {tiny.hidden}, {tiny.tokenizer} tokenizer)"
    else:
        text = "(none)"
    if model.lora is not None:
        text += f", LoRA r{model.lora.r}"
    return text + (", gradient checkpointing" if model.gradient_checkpointing else "")


def describe_data(config: Any) -> str:
    env = getattr(config, "env", None)
    if env is not None:
        return f"episodes of the {env.name} environment"
    data = config.data
    if data.task is not None:
        return f"task {data.task}: {data.n_train} training rows, {data.n_eval} held out"
    return data.path or ""


def describe_step(command: str, config: Any) -> str:
    if command == "rl":
        text = f"{config.prompts_per_step} prompts × {config.samples_per_prompt} samples"
        return text + f", up to {config.max_new_tokens} new tokens"
    micro = f" in {config.gradient_accumulation} micro-batches" if config.gradient_accumulation > 1 else ""
    return f"{config.batch_size} rows{micro}"


def describe_device(config: Any) -> str:
    device = resolve_device(config.device)
    name = str(device)
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_name(device)})"
    threads = config.threads if getattr(config, "threads", None) else torch.get_num_threads()
    text = f"{name}, {config.precision}" + (f", {threads} threads" if device.type == "cpu" else "")
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:
        text += f"; {processes} processes ({config.strategy})"
    return text
