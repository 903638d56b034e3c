"""LoRA adapters through peft, with the reference policy for free.

With adapters, π_ref is the same module with the adapters switched off, so KL to the
reference and DPO's reference log-probs need no second copy of the model in memory. A
finished run folds the adapters in (``save_merged``) and writes a plain transformers folder.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.logprobs import response_logprobs

# peft's task type by the class name's suffix; it decides which head stays fully trainable
_TASK_TYPES = {
    "ForCausalLM": "CAUSAL_LM",
    "ForTokenClassification": "TOKEN_CLS",
    "ForSequenceClassification": "SEQ_CLS",
}


def apply_lora(
    model: PreTrainedModel,
    *,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "all-linear",
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters (Hu et al. 2021: W + (α/r)·B·A, B = 0 at the start, so
    the wrapped model starts equal to ``model``) on ``target_modules``; only the adapters train.

    ``"all-linear"`` means every linear layer but the output layer. For a critic or a reward
    model (``...ForTokenClassification`` / ``...ForSequenceClassification``) the scalar head
    trains in full instead of through an adapter. ``model`` is modified in place.
    """
    suffix = next((s for s in _TASK_TYPES if type(model).__name__.endswith(s)), None)
    if suffix is None:
        raise TypeError(f"apply_lora supports {', '.join('*' + s for s in _TASK_TYPES)}, not {type(model).__name__}")
    heads = [] if suffix == "ForCausalLM" else ["score", "classifier"]
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        exclude_modules=heads or None,  # peft trains the head in full (modules_to_save); it cannot also adapt it
        task_type=_TASK_TYPES[suffix],
    )
    with warnings.catch_warnings():
        # peft reads transformers' renamed `is_gradient_checkpointing` (deprecated in transformers 5):
        # a warning about peft's code that every LoRA run would print and no user can act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


@contextlib.contextmanager
def reference_policy(model: Any) -> Iterator[Any]:
    """Inside this block ``model`` computes the reference policy: its adapters are disabled.

    For a model without adapters there is nothing to disable; the caller then needs a frozen
    copy instead, and this raises so that a KL to "the reference" never silently becomes a
    KL of the policy to itself.
    """
    if not isinstance(model, PeftModel):
        raise TypeError("reference_policy needs a LoRA (peft) model; without adapters keep a frozen copy")
    with model.disable_adapter():
        yield model


@torch.no_grad()
def reference_logprobs(
    model: PeftModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int | None = None,
    *,
    response_mask: Tensor | None = None,
    temperature: float = 1.0,
    lm_head_chunks: bool = False,
) -> Tensor:
    """log π_ref of the response tokens, ``[B, T]``: :func:`response_logprobs` with the adapters
    off and no gradient. Arguments as there."""
    with reference_policy(model):
        logprobs, _ = response_logprobs(
            model,
            input_ids,
            attention_mask,
            response_start,
            response_mask=response_mask,
            temperature=temperature,
            lm_head_chunks=lm_head_chunks,
        )
    return logprobs


def base_weights(module: torch.nn.Module) -> dict[str, Tensor]:
    """``module``'s state dict (a part of a peft model) without its adapters, under the plain
    names: the frozen base weights it had before ``apply_lora``."""
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in module.state_dict().items()
        if ".lora_" not in name
    }


def merge_adapters(model: PeftModel) -> PreTrainedModel:
    """Fold the adapters into the base weights and return the plain transformers model (for
    a final folder any tool loads). In place: the peft wrapper must not be used afterwards."""
    return model.merge_and_unload()


def save_merged(
    model: PeftModel,
    path: str | Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    in_place: bool = False,
) -> Path:
    """Write ``model`` with its adapters folded in as a plain folder that
    ``AutoModelForCausalLM.from_pretrained`` loads (no peft needed). Merges a copy unless
    ``in_place`` (which saves the copy's memory but ends the wrapper's use for training)."""
    merged = merge_adapters(model if in_place else copy.deepcopy(model))
    merged.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return Path(path)
