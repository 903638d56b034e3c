"""Where a run computes (``device``) and in which precision (``precision``), for every command.

``device: auto | cpu | cuda | cuda:N | mps`` — ``auto`` is the first CUDA GPU when one is visible,
else the CPU. Models (policy, reference, critic, reward model) live there; a rollout batch stays
on the CPU between stages (it is small, and scoring and bookkeeping are Python), and each
micro-batch is moved to the device for its forward pass and loss.

``precision: fp32 | bf16`` — bf16 runs the forward passes under ``torch.autocast`` in bfloat16
while the weights the optimizer updates, its state and the losses stay in float32 (mixed
precision as in Micikevicius et al., 2018, with bfloat16 needing no loss scaling). Log-probs are
computed from the logits in float32 whatever their dtype (``models/logprobs.py``). Generation
keeps the weights' own dtype.

A device this machine does not have is refused before anything loads, with what to set instead.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator

from posttrain.errors import PosttrainError

DEVICE_FORMS = "auto, cpu, cuda, cuda:N (N = 0, 1, ...), mps"
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
Precision = Literal["fp32", "bf16"]


class DeviceError(PosttrainError, ValueError):
    """The configured device is not valid or not present here; the message says what to set."""


def check_device_name(name: str) -> str:
    """``name`` if it is one of :data:`DEVICE_FORMS`, else a :class:`ValueError` listing them."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"device = {name!r} is not a device; valid: {DEVICE_FORMS}")
    return name


def resolve_device(name: str, key: str = "device") -> torch.device:
    """The ``torch.device`` a config's ``device`` names, checked against this machine: ``auto`` is
    ``cuda`` when a GPU is visible, else ``cpu``; an absent one is a :class:`DeviceError`."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise DeviceError(f"{key} = {name!r}, but {why} here: set {key}: cpu (or auto)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(
                f"{key} = {name!r}, but this machine has {count} GPU(s) (cuda:0 .. cuda:{count - 1}): "
                f"set {key}: cuda:0, or check CUDA_VISIBLE_DEVICES"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{key} = 'mps', but Apple's Metal backend is not available here: set {key}: cpu (or auto)")
    return device


@contextlib.contextmanager
def compute_precision(precision: Precision, device: torch.device) -> Iterator[None]:
    """The training forward passes' precision: bf16 autocast on ``device`` (float32 weights stay
    float32), or nothing for fp32; on CUDA, attention by any kernel but cuDNN's.

    cuDNN's attention builds a graph for every new shape (hundreds of milliseconds, cached by
    shape), and a training pass's shapes change with each micro-batch's longest sequence: on one
    H200 it was the largest host cost of a GRPO step (benchmarks/gpu_step.py ``step_profile``).
    Flash and memory-efficient attention take any shape at no build cost."""
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([getattr(SDPBackend, name) for name in TRAINING_ATTENTION]))
        if precision == "bf16":
            stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        yield


TRAINING_ATTENTION = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # torch's SDPBackend names, cuDNN's left out


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (posttrain keeps a model on one device)."""
    return next(model.parameters()).device


DeviceName = Annotated[str, AfterValidator(check_device_name)]
"""A config field holding one of :data:`DEVICE_FORMS` (checked when the config is read)."""


def precision_problem(precision: Precision, model_dtype: str) -> str | None:
    """Why ``precision`` cannot train weights of ``model_dtype`` (None when it can)."""
    if precision == "bf16" and model_dtype != "float32":
        return (
            f"precision = 'bf16' computes in bfloat16 over float32 master weights, but model.dtype = "
            f"{model_dtype!r}: set model.dtype: float32, or precision: fp32 to train the {model_dtype} "
            "weights as they are"
        )
    return None
