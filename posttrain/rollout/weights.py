"""The policy's weights as an inference engine loads them: plain checkpoint names, LoRA folded in.

An engine that keeps its own copy of the weights (vLLM) is handed the trainer's weights by
name, in the names a Hugging Face checkpoint of the model uses (``model.layers.0.mlp.up_proj.weight``),
because that is what its loaders map onto their own fused layouts. A LoRA policy (peft) is sent
as the model it computes: each adapted projection's weight is W + Σ (α/r)·B·A over the active
adapters, what the native engine fuses too (``projections.effective_weight``). The training model
is never modified: merging in place (peft's ``merge_and_unload``) would end its use for training.

Covers: plain causal LMs; peft LoRA on linear layers (several adapters, merged or disabled
adapters, rsLoRA scaling). Does not cover (refused with a reason): DoRA and other LoRA
variants, ``lora_bias`` and peft methods other than LoRA — their forward is not W + ΔW on a
plain weight. A module peft trains in full (``modules_to_save``) is sent as the copy it computes with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.rollout.projections import (
    effective_weight,
    is_lora_linear,
    is_peft_model,
    lora_terms,
    unsupported_lora,
)


def unmergeable_reason(model: nn.Module) -> str | None:
    """Why ``model``'s weights cannot be sent as one plain checkpoint (None when they can)."""
    if not is_peft_model(model):
        return None
    kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()})
    if kinds != ["LORA"]:
        return f"peft adapters of type {', '.join(kinds)} (only LoRA adapters are folded in)"
    for name, module in model.get_base_model().named_modules():
        if type(module).__module__.split(".")[0] == "peft" and hasattr(module, "lora_A"):
            if not is_lora_linear(module):
                return f"the peft module {name} ({type(module).__name__}); only LoRA around nn.Linear is folded in"
            reason = unsupported_lora(module)
            if reason is not None:
                return f"{name}: {reason}"
    return None


def inference_weights(model: nn.Module, whole: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``{checkpoint name: tensor}`` of what ``model`` computes with, detached.

    Plain model: its own state dict (the tensors themselves, no copy). LoRA (peft) model: the
    base model's tensors under their plain names, each adapted projection's ``weight`` replaced
    by a new tensor W + Σ scaling·B·A; the adapter matrices themselves are left out.
    ``whole``: the model's state dict gathered from FSDP2 shards (``World.full_weights``), whose
    tensors are used instead of the module's own (which are shards).
    """
    if not is_peft_model(model):
        return {name: tensor.detach() for name, tensor in (whole or model.state_dict()).items()}
    reason = unmergeable_reason(model)
    if reason is not None:
        raise ValueError(f"cannot send this LoRA policy to an inference engine: {reason}")
    base = model.get_base_model()
    if whole is None:
        tensors = base.state_dict()
    else:  # the peft model's names are the base model's under a prefix (base_model.model.)
        prefix = next(name for name, module in model.named_modules() if module is base) + "."
        tensors = {key.removeprefix(prefix): tensor for key, tensor in whole.items()}
    copies = _module_copies(base)
    weights: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        if ".lora_" in key:  # lora_A / lora_B / lora_embedding_*: folded into their layer below
            continue
        wrapper = next((name for name in copies if key.startswith(name)), None)
        if wrapper is not None:  # a module peft trains in full: the copy the model computes with
            if not key.startswith(copies[wrapper]):
                continue
            key = wrapper + key.removeprefix(copies[wrapper])
        weights[key.replace(".base_layer.", ".")] = tensor.detach()
    for name, module in base.named_modules():
        if is_lora_linear(module):
            weights[f"{name}.weight"] = (
                effective_weight(module) if whole is None else _folded(module, name, tensors)
            ).detach()
    return weights


def _module_copies(base: nn.Module) -> dict[str, str]:
    """``{"score.": "score.modules_to_save.default."}`` for each module peft trains in full
    (``modules_to_save``: a reward model's or critic's head), the prefix of the copy its forward
    uses: the trained one of the active adapter, or the original with adapters disabled."""
    copies = {}
    for name, module in base.named_modules():
        if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            trained = not module.disable_adapters and active
            copies[f"{name}."] = f"{name}.modules_to_save.{active[0]}." if trained else f"{name}.original_module."
    return copies


def _folded(projection: nn.Module, name: str, tensors: dict[str, Tensor]) -> Tensor:
    """:func:`effective_weight` of the LoRA layer ``name`` from whole tensors (``tensors``, the
    base model's state dict) instead of the layer's own parameters: W ± Σ scaling·B·A."""
    weight = tensors[f"{name}.base_layer.weight"]
    terms = lora_terms(projection)
    if not terms:
        return weight
    out = weight.clone()
    for adapter, sign in terms:
        a, b = tensors[f"{name}.lora_A.{adapter}.weight"], tensors[f"{name}.lora_B.{adapter}.weight"]
        if a.dtype == b.dtype == out.dtype and not projection.fan_in_fan_out:  # as effective_weight adds it
            out.addmm_(b, a, alpha=sign * projection.scaling[adapter])
        else:
            delta = (b.to(torch.float32) @ a.to(torch.float32)).mul_(projection.scaling[adapter])
            out.add_((delta.T if projection.fan_in_fan_out else delta).to(out.dtype), alpha=sign)
    return out


def save_inference_folder(
    model: nn.Module, tokenizer: Any | None, folder: str | Path, weights: dict[str, Tensor] | None = None
) -> Path:
    """Write ``model`` (LoRA folded in: ``weights``, by default :func:`inference_weights`) and
    ``tokenizer`` (if given) as a plain Hugging Face folder — ``config.json``,
    ``generation_config.json``, ``model.safetensors`` — that engines such as vLLM load by path;
    a LoRA run's ``final/`` is this folder.

    Written here rather than by ``save_pretrained``, which from transformers 5.19 writes nothing on
    a rank other than 0 once torch.distributed is up: each rank's engine (``strategy: fsdp2`` with
    ``rollout.engine: vllm``) loads a folder of its own. Tied copies (an output layer tied to the
    embeddings) are left out, as ``save_pretrained`` leaves them out; the loader ties them again."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if is_peft_model(model) else model
    weights = dict(weights if weights is not None else inference_weights(model))
    for tied, source in (getattr(base, "all_tied_weights_keys", None) or {}).items():
        if tied in weights and source in weights:
            del weights[tied]
    base.config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    stored: set[int] = set()
    tensors = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in stored:  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        stored.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
