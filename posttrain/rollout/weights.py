"""The policy's weights as an inference engine loads them: plain checkpoint names, LoRA folded in.

An engine that keeps its own copy of the weights (vLLM) is handed the trainer's weights by
name, in the names a Hugging Face checkpoint of the model uses (``model.layers.0.mlp.up_proj.weight``),
because that is what its loaders map onto their own fused layouts. A LoRA policy (peft) is sent
as the model it computes: each adapted projection's weight is W + Σ (α/r)·B·A over the active
adapters, what the native engine fuses too (``projections.effective_weight``). The training model
is never modified: merging in place (peft's ``merge_and_unload``) would end its use for training.

Covers: plain causal LMs; peft LoRA on linear layers (several adapters, merged or disabled
adapters, rsLoRA scaling). Does not cover (refused with a reason): DoRA and other LoRA
variants, ``lora_bias``, ``modules_to_save`` and peft methods other than LoRA — their
forward is not W + ΔW on a plain weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from posttrain.rollout.projections import effective_weight, is_lora_linear, is_peft_model, unsupported_lora


def unmergeable_reason(model: nn.Module) -> str | None:
    """Why ``model``'s weights cannot be sent as one plain checkpoint (None when they can)."""
    if not is_peft_model(model):
        return None
    kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()})
    if kinds != ["LORA"]:
        return f"peft adapters of type {', '.join(kinds)} (only LoRA adapters are folded in)"
    for name, module in model.get_base_model().named_modules():
        if "modules_to_save" in name.split("."):
            return f"peft modules_to_save ({name}): a trained copy of a whole module, not W + ΔW"
        if type(module).__module__.split(".")[0] == "peft" and hasattr(module, "lora_A"):
            if not is_lora_linear(module):
                return f"the peft module {name} ({type(module).__name__}); only LoRA around nn.Linear is folded in"
            reason = unsupported_lora(module)
            if reason is not None:
                return f"{name}: {reason}"
    return None


def inference_weights(model: nn.Module) -> dict[str, Tensor]:
    """``{checkpoint name: tensor}`` of what ``model`` computes with, detached.

    Plain model: its own state dict (the tensors themselves, no copy). LoRA (peft) model: the
    base model's tensors under their plain names, each adapted projection's ``weight`` replaced
    by a new tensor W + Σ scaling·B·A; the adapter matrices themselves are left out.
    """
    if not is_peft_model(model):
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    reason = unmergeable_reason(model)
    if reason is not None:
        raise ValueError(f"cannot send this LoRA policy to an inference engine: {reason}")
    base = model.get_base_model()
    weights: dict[str, Tensor] = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:  # lora_A / lora_B / lora_embedding_*: folded into their layer below
            continue
        weights[key.replace(".base_layer.", ".")] = tensor.detach()
    for name, module in base.named_modules():
        if is_lora_linear(module):
            weights[f"{name}.weight"] = effective_weight(module).detach()
    return weights


def save_inference_folder(
    model: nn.Module, tokenizer: Any | None, folder: str | Path, weights: dict[str, Tensor] | None = None
) -> Path:
    """Write ``model`` (LoRA folded in: ``weights``, by default :func:`inference_weights`) and
    ``tokenizer`` (if given) as a plain Hugging Face folder: engines such as vLLM load a model
    by path only, and a LoRA run's ``final/`` is this folder."""
    folder = Path(folder)
    base = model.get_base_model() if is_peft_model(model) else model
    # state_dict= makes transformers write these tensors under these names (and drop tied copies)
    base.save_pretrained(folder, state_dict=weights if weights is not None else inference_weights(model))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
