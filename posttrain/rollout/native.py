"""A compact forward pass with a preallocated KV cache for Llama- and Qwen2-family weights.

At the sizes posttrain trains on a CPU, a decoding step costs far more in Python overhead
(module calls, cache objects, mask building) than in arithmetic. This decoder does the
same maths as the transformers forward — RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU — with fused projections and a cache written in place, so a step is a
few dozen tensor ops. It reads the weights of the trainer's own module and re-fuses them
whenever an optimizer step has changed them (PyTorch counts in-place writes per tensor),
so colocated generation always samples from the current policy. Equality with the
transformers logits is a test (tests/rollout).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_TYPES = ("llama", "qwen2")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this decoder cannot run ``model`` (None when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} (only the default rotary embedding is implemented)"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if any(p.is_meta for p in model.parameters()):
        return "weights on the meta device"
    return None


class NativeDecoder:
    """Prefill and decode for one batch at a time; ``prefill`` starts a new batch."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native rollout engine cannot run this model: {reason}; use engine 'transformers'")
        self.model = model
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._rotary_table = torch.empty(2, 0, self.head_dim)
        self._versions: list[int] = []
        self.refresh()

    # ---- weights -------------------------------------------------------------------------
    def _sources(self) -> list[Tensor]:
        return [p for p in self.model.parameters()]

    def refresh(self) -> None:
        """Rebuild the fused weights from the model's current parameters."""
        with torch.no_grad():
            inner = self.model.model
            self.embed = inner.embed_tokens.weight
            self.final_norm = inner.norm.weight
            self.lm_head = self.model.lm_head.weight
            self.layers: list[dict[str, Any]] = []
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                biases = [m.bias for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
                self.layers.append(
                    {
                        "in_norm": layer.input_layernorm.weight,
                        "qkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                        "qkv_bias": None if biases[0] is None else torch.cat(biases),
                        "o": attn.o_proj.weight,
                        "o_bias": attn.o_proj.bias,
                        "post_norm": layer.post_attention_layernorm.weight,
                        "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                        "gate": mlp.gate_proj.weight,
                        "up": mlp.up_proj.weight,
                        "down": mlp.down_proj.weight,
                    }
                )
        self._versions = [p._version for p in self._sources()]

    def refresh_if_changed(self) -> None:
        """Re-fuse when any parameter was written since the last fuse (an optimizer step)."""
        if [p._version for p in self._sources()] != self._versions:
            self.refresh()

    # ---- forward -------------------------------------------------------------------------
    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def _rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin ``[..., D]`` for integer positions ``[...]`` (transformers' layout), read
        from a table computed exactly as transformers computes them."""
        needed = int(positions.max()) + 1
        if self._rotary_table.shape[-2] < needed:  # table: [2 (cos, sin), positions, D]
            size = max(needed, 2 * self._rotary_table.shape[-2], 256)
            freqs = torch.arange(size).float().unsqueeze(-1) * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rotary_table = torch.stack([emb.cos(), emb.sin()]).to(self.embed.dtype)
        return self._rotary_table[0][positions], self._rotary_table[1][positions]

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _layers(self, hidden: Tensor, cos: Tensor, sin: Tensor, start: int, bias: Tensor) -> Tensor:
        """Run every layer on ``hidden [B, T, H]`` whose keys/values go to cache[start:start+T]."""
        batch, steps, _ = hidden.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        end = start + steps
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index, w in enumerate(self.layers):
            x = self._rms_norm(hidden, w["in_norm"])
            qkv = torch.nn.functional.linear(x, w["qkv"], w["qkv_bias"])
            q, k, v = qkv.split((h * d, kv * d, kv * d), dim=-1)
            q = self._rotate(q.view(batch, steps, h, d).transpose(1, 2), cos, sin)
            k = self._rotate(k.view(batch, steps, kv, d).transpose(1, 2), cos, sin)
            self.keys[index, :, :, start:end] = k
            self.values[index, :, :, start:end] = v.view(batch, steps, kv, d).transpose(1, 2)
            keys, values = self.keys[index, :, :, :end], self.values[index, :, :, :end]
            # grouped-query attention without copying keys: [B, kv, group, T, d] @ [B, kv, 1, d, S]
            grouped = q.reshape(batch, kv, h // kv, steps, d)
            scores = grouped @ keys.unsqueeze(2).transpose(-1, -2) * self.scale + bias
            attn = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values.unsqueeze(2)
            attn = attn.reshape(batch, h, steps, d).transpose(1, 2).reshape(batch, steps, h * d)
            hidden = hidden + torch.nn.functional.linear(attn, w["o"], w["o_bias"])
            x = self._rms_norm(hidden, w["post_norm"])
            gate, up = torch.nn.functional.linear(x, w["gate_up"]).chunk(2, dim=-1)
            hidden = hidden + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w["down"])
        return self._rms_norm(hidden, self.final_norm)

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, repeats: int = 1) -> Tensor:
        """Start a batch of left-padded prompts ``[B, P]``, each to be continued ``repeats``
        times (the group): every prompt is encoded once and its cache copied. Returns the
        next-token logits ``[B·repeats, V]``, prompt-major."""
        self.refresh_if_changed()
        batch, length = input_ids.shape
        capacity = length + max_new_tokens
        dtype, device = self.embed.dtype, self.embed.device
        shape = (len(self.layers), batch, self.num_kv_heads, capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.min_value = torch.finfo(dtype).min
        valid = attention_mask.bool()
        # a finite "minus infinity": fully masked rows (pure padding) stay finite, not NaN
        self.key_bias = torch.zeros(batch, 1, 1, 1, capacity, dtype=dtype, device=device)
        self.key_bias[:, 0, 0, 0, :length].masked_fill_(~valid, self.min_value)
        self.key_bias[:, 0, 0, 0, length:] = self.min_value  # not yet written
        causal = torch.full((length, length), self.min_value, dtype=dtype, device=device).triu(1)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        self.next_position = positions[:, -1] + 1
        self.length = length
        cos, sin = self._rotary(positions)
        bias = self.key_bias[..., :length] + causal
        hidden = self._layers(self.embed[input_ids], cos, sin, 0, bias)
        logits = torch.nn.functional.linear(hidden[:, -1], self.lm_head)
        if repeats > 1:
            self.keys = self.keys.repeat_interleave(repeats, dim=1)
            self.values = self.values.repeat_interleave(repeats, dim=1)
            self.key_bias = self.key_bias.repeat_interleave(repeats, dim=0)
            self.next_position = self.next_position.repeat_interleave(repeats)
            logits = logits.repeat_interleave(repeats, dim=0)
        # decode reads one query per row: keep a [B, 1, S] bias view for it
        self.decode_bias = self.key_bias.view(self.key_bias.shape[0], 1, capacity)
        return logits

    @torch.inference_mode()
    def decode(self, tokens: Tensor) -> Tensor:
        """Append one token per row ``[B]``; return the next-token logits ``[B, V]``.

        The one-query case is written out with 2-D activations and elementwise attention:
        at these sizes batched tiny matrix products cost more in dispatch than they compute.
        """
        start = self.length
        end = start + 1
        self.decode_bias[:, 0, start] = 0.0
        cos, sin = self._rotary(self.next_position)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, D] against [B, heads, D]
        batch = tokens.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        group = h // kv
        bias = self.decode_bias[:, :, :end]  # [B, 1, S]
        linear = torch.nn.functional.linear
        hidden = self.embed[tokens]  # [B, H]
        for index, w in enumerate(self.layers):
            x = self._rms_norm(hidden, w["in_norm"])
            qkv = linear(x, w["qkv"], w["qkv_bias"])
            q, k, v = qkv.split((h * d, kv * d, kv * d), dim=-1)
            q = self._rotate(q.view(batch, h, d), cos, sin)
            self.keys[index, :, :, start] = self._rotate(k.view(batch, kv, d), cos, sin)
            self.values[index, :, :, start] = v.view(batch, kv, d)
            keys, values = self.keys[index, :, :, :end], self.values[index, :, :, :end]  # [B, kv, S, d]
            q = q.view(batch, kv, group, d)
            scores = torch.matmul(q, keys.transpose(-1, -2)).view(batch, h, end) * self.scale + bias
            probs = torch.softmax(scores, dim=-1).view(batch, kv, group, end)
            attn = torch.matmul(probs, values).reshape(batch, h * d)
            hidden = hidden + linear(attn, w["o"], w["o_bias"])
            x = self._rms_norm(hidden, w["post_norm"])
            # two products instead of one fused: SiLU on a strided half of a fused output
            # costs more than the extra call
            gate = torch.nn.functional.silu(linear(x, w["gate"]))
            hidden = hidden + linear(gate * linear(x, w["up"]), w["down"])
        self.length = end
        self.next_position = self.next_position + 1
        return linear(self._rms_norm(hidden, self.final_norm), self.lm_head)
