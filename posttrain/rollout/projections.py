"""What the native decoder can run, and the weight each projection multiplies by.

A LoRA policy (a peft model from ``posttrain.models.lora.apply_lora``) runs in the native decoder too: each
adapted projection is fused with its effective weight W + Σ (α/r)·B·A over the active
adapters, what peft's forward computes with (the base weight alone while the adapters are
disabled, e.g. inside ``reference_policy``). Covered: plain LoRA on the attention and MLP
projections, several active adapters, merged adapters, rsLoRA scaling. Not covered, and
refused with a reason: DoRA and the other LoRA variants, ``lora_bias``, adapters or trainable
rows on the embeddings or the output layer, ``modules_to_save``, peft methods other than
LoRA, quantized base layers. With active adapters o_proj and down_proj are fused too, so the
fused layers then hold one copy of every projection (the embeddings and the output layer are
never copied). In bfloat16, W + ΔW is rounded to bfloat16 where peft adds the adapter's
output instead: the two then differ by bfloat16 rounding (in float32 they agree to 1e-5,
tests/rollout/test_native_lora.py).
"""

from __future__ import annotations

import re
import sys

import torch
from torch import Tensor, nn

from posttrain.distributed import is_sharded

SUPPORTED_TYPES = ("llama", "qwen2")

# the only places a peft module may sit: the attention and MLP projections of a decoder layer
_PROJECTION_NAME = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this decoder cannot run ``model`` exactly as transformers (or peft) would (None when it can)."""
    if is_sharded(model):  # its weights are FSDP2 shards, gathered by the model's own forward passes
        return "its parameters are FSDP2 shards (strategy: fsdp2)"
    if is_peft_model(model):
        kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()})
        if kinds != ["LORA"]:
            return f"peft adapters of type {', '.join(kinds)} (only LoRA adapters are fused)"
        model = model.get_base_model()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    accepted = None  # the last LoRA layer passed: what sits inside it is unsupported_lora's to judge
    for name, module in model.named_modules():  # depth first: a module's children come right after it
        if type(module).__module__.split(".")[0] != "peft" or (accepted and name.startswith(accepted)):
            continue
        accepted = name + "."
        if not _PROJECTION_NAME.fullmatch(name) or not is_lora_linear(module):
            return (
                f"the peft module {name} ({type(module).__name__}); only LoRA on the attention and MLP "
                "projections is fused (not on embed_tokens or lm_head, nor modules_to_save)"
            )
    inner = getattr(model, "model", None)
    if not isinstance(getattr(model, "lm_head", None), nn.Linear) or not hasattr(inner, "layers"):
        return f"{type(model).__name__} is not a plain *ForCausalLM module (wrapped, e.g. by an adapter library?)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} (only the default rotary embedding is implemented)"
    if getattr(inner.rotary_emb, "attention_scaling", 1.0) != 1.0:
        return "a rotary embedding with attention scaling"
    if getattr(config, "use_sliding_window", False) or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()
    ):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only SiLU is implemented)"
    return _unsupported_layer(model, model_type)


def _unsupported_layer(model: nn.Module, model_type: str) -> str | None:
    """Checks on the modules themselves: plain linear layers, biases only where Qwen2 has them."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(p) is not nn.Linear and not is_lora_linear(p) for p in projections):
            return "projections that are neither plain nn.Linear nor peft LoRA layers (quantized layers?)"
        for p in projections:
            if type(p) is not nn.Linear and (reason := unsupported_lora(p)) is not None:
                return reason
        biased = [base_layer(p).bias is not None for p in projections]
        expected = [model_type == "qwen2"] * 3 + [False] * 4  # Qwen2: q/k/v biases only
        if biased != expected:
            return "attention or MLP biases other than Qwen2's q/k/v biases"
    if any(p.is_meta for p in model.parameters()):
        return "weights on the meta device"
    return None


def is_peft_model(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a peft model cannot exist unless peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def is_lora_linear(module: nn.Module) -> bool:
    """A peft LoRA layer around an ``nn.Linear`` (exactly that class: subclasses wrap quantized layers)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import Linear

    return type(module) is Linear


def base_layer(projection: nn.Module) -> nn.Module:
    return projection if type(projection) is nn.Linear else projection.get_base_layer()


def unsupported_lora(layer: nn.Module) -> str | None:
    """What of a peft LoRA layer W + (α/r)·B·A fusing could not reproduce (None when nothing)."""
    if type(layer.get_base_layer()) is not nn.Linear:
        return f"a LoRA layer around {type(layer.get_base_layer()).__name__} (only around nn.Linear)"
    variants, biases = getattr(layer, "lora_variant", {}), getattr(layer, "lora_bias", {})  # newer peft only
    for name in layer.lora_A:
        if layer.use_dora.get(name, False):
            return f"DoRA (use_dora, adapter {name!r}); only plain LoRA is fused"
        if name in variants:
            return f"the LoRA variant {type(variants[name]).__name__} (adapter {name!r}); only plain LoRA"
        if biases.get(name, False):
            return f"LoRA with lora_bias (adapter {name!r})"
    return None


def lora_terms(projection: nn.Module) -> list[tuple[str, int]]:
    """The adapters whose ΔW = scaling·B·A the effective weight adds (+1) or takes off (−1),
    following peft's ``lora.Linear.forward``:

    - adapters disabled: the base weight; peft unmerges merged adapters first, here their
      deltas are taken off the copy, so the model is left as it is;
    - some adapters merged: the base weight, which holds them (peft adds nothing on top);
    - otherwise: W + Σ ΔW over the active adapters (lora dropout is off in eval).
    """
    if type(projection) is nn.Linear:
        return []
    if projection.disable_adapters:
        return [(name, -1) for name in reversed(projection.merged_adapters)]
    if projection.merged:
        return []
    return [(name, 1) for name in projection.active_adapters if name in projection.lora_A]


def has_delta(projection: nn.Module) -> bool:
    """Whether ``projection``'s effective weight differs from its base weight (active LoRA deltas)."""
    return bool(lora_terms(projection))


def effective_weight(projection: nn.Module, out: Tensor | None = None, heads: int | None = None) -> Tensor:
    """The weight ``[out_features, in]`` that ``projection`` (nn.Linear or peft LoRA) multiplies
    its input by, written into ``out`` (rows pair-interleaved per head as by
    :func:`interleave_pairs` when ``heads`` is given). Without ``out``: the layer's own weight,
    not a copy, when there is no delta to add, else a new tensor."""
    weight = base_layer(projection).weight
    terms = lora_terms(projection)
    if out is None:
        if not terms:
            return weight
        out = torch.empty_like(weight)
    if heads is None:
        out.copy_(weight)
    else:  # one strided copy: row (h, half, i) of the weight goes to row (h, i, half)
        out.unflatten(0, (heads, -1, 2)).transpose(1, 2).copy_(weight.unflatten(0, (heads, 2, -1)))
    for name, sign in terms:
        if name in getattr(projection, "lora_variant", {}):  # e.g. an adapter added after the construction check
            raise ValueError(f"the native rollout engine cannot fuse the LoRA variant of adapter {name!r}")
        a, b = projection.lora_A[name].weight, projection.lora_B[name].weight  # [r, in], [out, r]
        if a.dtype == b.dtype == out.dtype and not projection.fan_in_fan_out:
            # ± scaling·B·A added in place: no ΔW-sized temporary
            b = b if heads is None else interleave_pairs(b, heads)
            out.addmm_(b, a, alpha=sign * projection.scaling[name])
        else:  # peft's own arithmetic: ΔW in the adapters' dtype, then cast
            delta = projection.get_delta_weight(name).to(out.dtype)
            out.add_(delta if heads is None else interleave_pairs(delta, heads), alpha=sign)
    return out


def interleave_pairs(weight: Tensor, heads: int) -> Tensor:
    """Reorder the rows of each head from (0 … D/2−1, D/2 … D−1) to (0, D/2, 1, D/2+1, …).

    ``weight`` is ``[heads·D, …]`` (a projection weight or bias); after this, rotating the pair
    (i, i + D/2) by an angle is multiplying the complex number formed by rows 2i and 2i+1.
    """
    rest = weight.shape[1:]
    per_head = weight.reshape(heads, 2, -1, *rest)  # [heads, half (first/second), D/2, ...]
    return per_head.transpose(1, 2).reshape(weight.shape)
