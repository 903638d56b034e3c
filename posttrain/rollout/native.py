"""A compact forward pass with a preallocated KV cache for Llama- and Qwen2-family weights.

At the sizes posttrain trains on a CPU a decoding step costs more in per-op overhead (module
calls, cache objects, mask building, a dozen small elementwise ops for RMSNorm and rotary
embeddings) than in arithmetic. This decoder does the same maths as the transformers forward
— RMSNorm, rotary embeddings, grouped-query attention, SwiGLU — in about a dozen tensor ops
per layer and step:

- q, k and v come from one product, gate and up from another (weights fused by ``refresh``);
- the rotary embedding is one complex multiply: the q and k rows of each head are permuted so
  that the pairs it rotates, (i, i + D/2), sit next to each other. Attention only ever takes
  dot products of q with k, so permuting both the same way changes nothing;
- the KV cache is written in place; a decoding step's attention is one ``baddbmm`` and one
  ``bmm`` over (row, kv head) pairs;
- residual adds ride along in ``addmm``.

The decoder reads the weights of the trainer's own module and re-fuses them when they have
changed (PyTorch counts in-place writes per tensor, so an optimizer step is noticed), so
colocated generation always samples from the current policy. Equality with the transformers
logits is a test (tests/rollout/test_native.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_TYPES = ("llama", "qwen2")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this decoder cannot run ``model`` exactly as transformers would (None when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
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
        if any(type(p) is not nn.Linear for p in projections):
            return "projections that are not plain nn.Linear (adapters or quantized layers)"
        biased = [p.bias is not None for p in projections]
        expected = [model_type == "qwen2"] * 3 + [False] * 4  # Qwen2: q/k/v biases only
        if biased != expected:
            return "attention or MLP biases other than Qwen2's q/k/v biases"
    if any(p.is_meta for p in model.parameters()):
        return "weights on the meta device"
    return None


class FusedLayer(NamedTuple):
    """One decoder layer's weights, arranged for the forward below."""

    in_norm: Tensor  # [H]
    qkv: Tensor  # [(heads + 2·kv_heads)·D, H]; q and k rows pair-interleaved per head
    qkv_bias: Tensor | None  # [(heads + 2·kv_heads)·D] (Qwen2) or None
    o_t: Tensor  # [heads·D, H], a transposed view of o_proj.weight, for addmm
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2·I, H]
    down_t: Tensor  # [I, H], a transposed view of down_proj.weight


def _interleave_pairs(weight: Tensor, heads: int) -> Tensor:
    """Reorder the rows of each head from (0 … D/2−1, D/2 … D−1) to (0, D/2, 1, D/2+1, …).

    ``weight`` is ``[heads·D, …]`` (a projection weight or bias); after this, rotating the pair
    (i, i + D/2) by an angle is multiplying the complex number formed by rows 2i and 2i+1.
    """
    rest = weight.shape[1:]
    per_head = weight.reshape(heads, 2, -1, *rest)  # [heads, half (first/second), D/2, ...]
    return per_head.transpose(1, 2).reshape(weight.shape)


class NativeDecoder:
    """Prefill and decode for one batch at a time; ``prefill`` starts a new batch."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native rollout engine cannot run this model: {reason}; use engine 'transformers'")
        self.model = model
        config = model.config
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self._angles = torch.empty(0, self.head_dim // 2)
        self._sources: list[tuple[Tensor, int, int]] = []
        self.refresh()

    # ---- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused weights from the model's current parameters."""
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = self.model.lm_head.weight
        # the model's own inverse frequencies, so the angles match transformers bit for bit
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.layers = [self._fuse(layer) for layer in inner.layers]
        self._sources = self._fingerprint()

    def _fuse(self, layer: nn.Module) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        q, k = _interleave_pairs(attn.q_proj.weight, self.heads), _interleave_pairs(attn.k_proj.weight, self.kv_heads)
        bias = None
        if attn.q_proj.bias is not None:
            q_bias = _interleave_pairs(attn.q_proj.bias, self.heads)
            bias = torch.cat([q_bias, _interleave_pairs(attn.k_proj.bias, self.kv_heads), attn.v_proj.bias])
        return FusedLayer(
            in_norm=layer.input_layernorm.weight,
            qkv=torch.cat([q, k, attn.v_proj.weight]),
            qkv_bias=bias,
            o_t=attn.o_proj.weight.t(),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            down_t=mlp.down_proj.weight.t(),
        )

    def _fingerprint(self) -> list[tuple[Tensor, int, int]]:
        # a parameter's version counts in-place writes (optimizer steps, load_state_dict);
        # its data pointer changes when it is moved or replaced through ``.data``
        return [(p, p._version, p.data_ptr()) for p in self.model.parameters()]

    def refresh_if_changed(self) -> None:
        """Re-fuse when any parameter was written or replaced since the last fuse."""
        current = self._fingerprint()
        if len(current) != len(self._sources) or any(
            a is not b or va != vb or pa != pb for (a, va, pa), (b, vb, pb) in zip(current, self._sources, strict=True)
        ):
            self.refresh()

    # ---- pieces of the forward -------------------------------------------------------------
    def _rotations(self, positions: Tensor) -> Tensor:
        """Unit complex numbers ``[..., D/2]`` rotating each pair at integer ``positions [...]``."""
        needed = int(positions.max()) + 1
        if self._angles.shape[0] < needed:  # [positions, D/2], grown by doubling
            size = max(needed, 2 * self._angles.shape[0], 256)
            # position × inverse frequency, then cos and sin: the same float32 ops as transformers
            self._angles = torch.arange(size, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        angles = self._angles[positions]
        return torch.complex(angles.cos(), angles.sin())

    def _rope(self, qk: Tensor, rotations: Tensor) -> Tensor:
        """Rotate pair-interleaved ``qk [..., heads, D]`` by ``rotations [..., 1, D/2]`` (complex)."""
        if qk.dtype != torch.float32:  # no complex type below float32: rotate in float32
            return self._rope(qk.float(), rotations).to(qk.dtype)
        pairs = torch.view_as_complex(qk.unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * rotations).flatten(-2)

    def _mlp(self, hidden: Tensor, w: FusedLayer) -> Tensor:
        """``hidden + down(silu(gate(x)) · up(x))`` with ``x = RMSNorm(hidden)``, for ``[N, H]``."""
        x = F.rms_norm(hidden, (self.hidden,), w.post_norm, self.eps)
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return torch.addmm(hidden, F.silu(gate) * up, w.down_t)

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, repeats: int = 1) -> Tensor:
        """Start a batch of left-padded prompts ``input_ids [U, P]`` (``attention_mask [U, P]``,
        1 on real tokens), each continued ``repeats`` times: every prompt is encoded once and
        its keys and values are written into the cache rows of all its samples. Returns the
        next-token logits ``[U·repeats, V]``, prompt-major."""
        self.refresh_if_changed()
        prompts, length = input_ids.shape
        batch, capacity = prompts * repeats, length + max_new_tokens
        kv, d, dtype = self.kv_heads, self.head_dim, self.embed.dtype
        # empty, not zeros: attention only reads positions already written
        shape = (len(self.layers), batch, kv, capacity, d)
        self.keys = torch.empty(shape, dtype=dtype, device=self.embed.device)
        self.values = torch.empty(shape, dtype=dtype, device=self.embed.device)
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)
        valid = attention_mask.bool()
        positions = valid.long().cumsum(-1).sub_(1).clamp_(min=0)
        # decoding step t of a row sits at position (real prompt tokens) + t
        steps = positions[:, -1:] + 1 + torch.arange(max_new_tokens, device=positions.device)
        self.step_rotations = self._rotations(steps).repeat_interleave(repeats, 0).unsqueeze(2)  # [B, T, 1, D/2]
        self.length, self.step = length, 0
        # additive masks with a finite minimum: a padding query then attends uniformly
        # (finite) instead of to nothing (NaN) — its output is never read
        minimum = torch.finfo(dtype).min
        self.decode_bias = torch.zeros(batch, 1, 1, capacity, dtype=dtype, device=self.embed.device)
        self.decode_bias[..., :length].masked_fill_(~valid.repeat_interleave(repeats, 0)[:, None, None], minimum)
        causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
        allowed = causal & valid[:, None, None, :]  # [U, 1, P, P]
        bias = torch.full(allowed.shape, minimum, dtype=dtype, device=valid.device).masked_fill_(allowed, 0.0)
        hidden = self._prefill_layers(self.embed[input_ids], self._rotations(positions).unsqueeze(2), bias, repeats)
        logits = F.linear(F.rms_norm(hidden, (self.hidden,), self.final_norm, self.eps), self.lm_head)
        return logits.repeat_interleave(repeats, 0)

    def _prefill_layers(self, hidden: Tensor, rotations: Tensor, bias: Tensor, repeats: int) -> Tensor:
        """Run the layers on ``hidden [U, P, H]``; return the last position's output ``[U, H]``.

        The last layer needs keys and values everywhere but its output only at the last
        position, so its attention and MLP run on that position alone.
        """
        prompts, length, _ = hidden.shape
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        for index, w in enumerate(self.layers):
            x = F.rms_norm(hidden, (self.hidden,), w.in_norm, self.eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)  # [U, P, (h + 2kv)·d]
            qk = self._rope(qkv[..., : (h + kv) * d].unflatten(-1, (h + kv, d)), rotations).transpose(1, 2)
            q, k = qk[:, :h], qk[:, h:]  # [U, heads, P, d]
            v = qkv[..., (h + kv) * d :].unflatten(-1, (kv, d)).transpose(1, 2)
            # every sample of a prompt starts from the same keys and values
            grouped = (prompts, repeats, kv, self.keys.shape[-2], d)
            self.keys[index].view(grouped)[..., :length, :] = k.unsqueeze(1)
            self.values[index].view(grouped)[..., :length, :] = v.unsqueeze(1)
            last = index == len(self.layers) - 1
            if last:
                q, bias, hidden = q[:, :, -1:], bias[:, :, -1:], hidden[:, -1:]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=kv != h)  # [U, h, P|1, d]
            attn = attn.transpose(1, 2).flatten(2)
            hidden = torch.addmm(hidden.flatten(0, 1), attn.flatten(0, 1), w.o_t)
            hidden = self._mlp(hidden, w).unflatten(0, (prompts, -1))
        return hidden[:, -1]

    # ---- decode ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, tokens: Tensor) -> Tensor:
        """Append one token per row ``tokens [B]``; return the next-token logits ``[B, V]``."""
        position, end = self.length, self.length + 1
        rotations = self.step_rotations[:, self.step]  # [B, 1, D/2]
        batch = tokens.shape[0]
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        # one query per row: attention is a batch of [group, d] @ [d, S] products, one per
        # (row, kv head), written out with baddbmm/bmm (cheaper here than SDPA's kernel)
        bias = self.decode_bias[..., :end].expand(batch, kv, h // kv, end).reshape(batch * kv, h // kv, end)
        hidden = F.embedding(tokens, self.embed)  # [B, H]
        for w, keys, values in zip(self.layers, self.layer_keys, self.layer_values, strict=True):
            x = F.rms_norm(hidden, (self.hidden,), w.in_norm, self.eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)  # [B, (h + 2kv)·d]
            qk = self._rope(qkv[:, : (h + kv) * d].view(batch, h + kv, d), rotations)
            keys.select(2, position).copy_(qk[:, h:])
            values.select(2, position).copy_(qkv[:, (h + kv) * d :].view(batch, kv, d))
            queries = qk[:, :h].reshape(batch * kv, h // kv, d)
            scores = torch.baddbmm(bias, queries, keys[:, :, :end].flatten(0, 1).transpose(1, 2), alpha=self.scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), values[:, :, :end].flatten(0, 1))  # [B·kv, group, d]
            hidden = torch.addmm(hidden, attn.view(batch, h * d), w.o_t)
            hidden = self._mlp(hidden, w)
        self.length, self.step = end, self.step + 1
        return F.linear(F.rms_norm(hidden, (self.hidden,), self.final_norm, self.eps), self.lm_head)

    @torch.inference_mode()
    def select(self, rows: Tensor) -> None:
        """Keep only the running rows ``rows [B']`` (finished ones are dropped)."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)
        self.step_rotations, self.decode_bias = self.step_rotations[rows], self.decode_bias[rows]
