"""Running out of memory ends a run in one message, not a traceback.

The loops mark their stages (``with stage("update", step):``); an out-of-memory error passing
through one is tagged with the innermost stage it left. The command line turns it into an
:class:`OutOfMemory` (exit 2): what ran out (the GPU or the machine's memory), in which stage
and step, the peak seen against what the device has, which keys lower that stage's memory, and
where the run continues from (checkpoints are written whole or not at all, so the last one is
intact and ``--resume auto`` takes it).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import PosttrainError
from posttrain.run.checkpoint import latest_checkpoint

# what lowers each stage's memory, in the order to try; the keys whose values the message quotes
SETTINGS = {
    "generation": ("prompts_per_step", "samples_per_prompt", "max_new_tokens"),
    "evaluation": ("eval_batch_size", "max_new_tokens"),
    "log-probs": ("micro_batch_tokens", "micro_batch_size"),
    "update": ("micro_batch_tokens", "micro_batch_size", "model.gradient_checkpointing"),
    "training step": ("micro_batch_tokens", "batch_size", "gradient_accumulation", "model.gradient_checkpointing"),
}
REMEDIES = {
    "generation": "prompts_per_step, samples_per_prompt or max_new_tokens",
    "evaluation": "eval_batch_size (held-out sequences generated at once) or max_new_tokens",
    "log-probs": "micro_batch_tokens (tokens per forward pass) or micro_batch_size (samples per pass)",
    "update": "micro_batch_tokens (tokens per forward/backward pass) or micro_batch_size (samples per pass), "
    "or set model.gradient_checkpointing: true, or train LoRA adapters (model.lora.r)",
    "training step": "micro_batch_tokens (tokens per pass) or batch_size, or raise gradient_accumulation "
    "(the same batch in smaller passes), "
    "or set model.gradient_checkpointing: true",
}


class OutOfMemory(PosttrainError, MemoryError):
    """A run ran out of memory; the message says where and what to lower."""


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error, or an allocation the CPU refused."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error)


_ACTIVE: list[str] = []  # the stages entered and not yet left, innermost last


@contextmanager
def stage(name: str, step: int | None = None) -> Iterator[None]:
    """Tag an out-of-memory error raised inside with ``name`` and ``step`` (the innermost wins)."""
    _ACTIVE.append(name)
    try:
        yield
    except BaseException as error:
        if is_out_of_memory(error) and not hasattr(error, "posttrain_stage"):
            error.posttrain_stage = (name, step)
        raise
    finally:
        _ACTIVE.pop()


def current_stage() -> str | None:
    """The innermost stage running now (read by the memory benchmark's sampler), None outside any."""
    return _ACTIVE[-1] if _ACTIVE else None


def out_of_memory(error: BaseException, config: Any) -> OutOfMemory:
    """The message for ``error`` (out of memory) in a run of ``config``."""
    name, step = getattr(error, "posttrain_stage", (None, None))
    where = (f" in the {name}" if name else "") + (f" of step {step}" if step else "")
    gpu = isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available()
    lines = [f"ran out of {'GPU memory' if gpu else 'memory'}{where} ({_peak(gpu)})."]
    remedy = REMEDIES.get(name or "")
    if remedy:
        now = ", ".join(f"{key} {_value(config, key)}" for key in SETTINGS[name] if _value(config, key) != "?")
        lines.append(f"It ran with {now}: lower {remedy}." if now else f"Lower {remedy}.")
    lines.append(_resume_hint(Path(config.output_dir)))
    return OutOfMemory(" ".join(lines))


def _value(config: Any, key: str) -> str:
    """``config``'s value at the dotted ``key`` as the message shows it ("?" where it has none)."""
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part, "?")
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _peak(gpu: bool) -> str:
    if gpu:
        device = torch.cuda.current_device()
        peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
        return f"peak {_gib(peak)} allocated of the card's {_gib(total)}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return f"peak {_gib(peak)} resident of the machine's {_gib(total)}" if total else f"peak {_gib(peak)} resident"


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def _resume_hint(out: Path) -> str:
    checkpoint = latest_checkpoint(out) if out.is_dir() else None
    if checkpoint is None:
        return "No checkpoint was written yet: the run starts over."
    return f"The last checkpoint, {checkpoint.path}, is intact: --resume auto continues from it."
