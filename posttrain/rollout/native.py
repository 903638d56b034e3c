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

A LoRA policy runs here too: ``projections.py`` says what is supported and folds the adapters
into each projection's effective weight.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.rollout.prefill_layout import lay_out
from posttrain.rollout.products import PACK_FROM_ROW_STEPS, WEIGHT_MAJOR_FROM, StepProducts, linear, packs_pay
from posttrain.rollout.projections import (
    base_layer,
    effective_weight,
    has_delta,
    interleave_pairs,
    is_lora_linear,
    is_peft_model,
    unsupported_reason,
)
from posttrain.rollout.rotary import rotate_pairs

if TYPE_CHECKING:
    from posttrain.rollout.turn_cache import Reuse


class FusedLayer(NamedTuple):
    """One decoder layer's weights, arranged for the forward below."""

    in_norm: Tensor  # [H]
    qkv: Tensor  # [(heads + 2·kv_heads)·D, H]; q and k rows pair-interleaved per head
    qkv_bias: Tensor | None  # [(heads + 2·kv_heads)·D] (Qwen2) or None
    o: Tensor  # [H, heads·D], o_proj's weight
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2·I, H]
    down: Tensor  # [H, I], down_proj's weight


class NativeDecoder:
    """Prefill and decode for one batch at a time; ``prefill`` starts a new batch.

    ``decode`` returns its logits in a buffer that the next ``decode`` overwrites.
    """

    LOGIT_CHUNK = 4096  # vocabulary rows per product of the output layer in decode
    # prompts that begin with this many tokens alike encode them once (a system message, a tool list);
    # below it the extra pass over the layers costs about what it saves
    MIN_SHARED = 64

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native rollout engine cannot run this model: {reason}; use engine 'transformers'")
        self.model = model
        # the *ForCausalLM itself; for a peft model the one it wraps, with the LoRA layers inside
        self.causal_lm = model.get_base_model() if is_peft_model(model) else model
        config = self.causal_lm.config
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        # None: compute in the weights' own dtype; else (bf16 over float32 masters) in copies
        self.dtype = dtype
        # weight-major decoding pays where a CPU streams weights from memory, not for a model that
        # sits in cache (tiny 128-wide models: 0.78 → 0.95 ms a step; SmolLM2's 576: ~9% faster)
        device = next(model.parameters()).device
        self.products = StepProducts(weight_major=self.hidden >= WEIGHT_MAJOR_FROM and device.type == "cpu")
        self._angles = torch.empty(0, self.head_dim // 2)
        self._lora_layers: list[nn.Module] = []
        self._sources: tuple[list[tuple[Tensor, int, int]], list[tuple]] = ([], [])
        self._copies: dict[str, Tensor] = {}  # derived weights by name, rewritten in place
        self.refresh()
        # there too, MKL's packed copies of the weights for a batch long enough to repay them
        nbytes = sum(t.numel() * t.element_size() for t in self._step_weights())
        self.products.packing = packs_pay(device, self.embed.dtype, self.hidden, nbytes)

    # ---- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the derived weights from the model's current parameters.

        Every derived tensor (fused matrices, dtype copies) is written into the memory of its
        previous version when there is one, so a step captured as a CUDA graph, which reads
        weights at fixed addresses, sees the new values (static_decode.py)."""
        self.products.clear()  # packs made from the values about to be rewritten
        inner = self.causal_lm.model
        self.embed = self._own("embed", inner.embed_tokens.weight)
        self.final_norm = self._own("final_norm", inner.norm.weight)
        head = self.causal_lm.lm_head.weight
        # tied embeddings stay tied: a copy of each would be one weight stored twice
        self.lm_head = self.embed if head is inner.embed_tokens.weight else self._own("lm_head", head)
        # the model's own inverse frequencies, so the angles match transformers bit for bit
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.layers = [self._fuse(index, layer) for index, layer in enumerate(inner.layers)]
        projections = (p for layer in inner.layers for p in (*layer.self_attn.children(), *layer.mlp.children()))
        self._lora_layers = [p for p in projections if is_lora_linear(p)]
        self._sources = self._fingerprint()

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """The derived weight ``name``'s memory: the last one when it still fits, else new."""
        dtype = self.dtype or like.dtype
        held = self._copies.get(name)
        if held is None or held.shape != shape or held.dtype != dtype or held.device != like.device:
            held = self._copies[name] = torch.empty(shape, dtype=dtype, device=like.device)
        return held

    def _own(self, name: str, weight: Tensor) -> Tensor:
        """``weight`` itself when the decoder computes in its dtype, else a copy in the decoder's."""
        if self.dtype is None or weight.dtype == self.dtype:
            return weight
        return self._buffer(name, tuple(weight.shape), weight).copy_(weight)

    def _projection(self, name: str, projection: nn.Module) -> Tensor:
        """A projection's effective weight: its own weight when nothing is added or cast."""
        weight = base_layer(projection).weight
        if not has_delta(projection):
            return self._own(name, weight)
        return effective_weight(projection, out=self._buffer(name, tuple(weight.shape), weight))

    def _fuse(self, index: int, layer: nn.Module) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = self._stack(f"{index}.qkv", [attn.q_proj, attn.k_proj, attn.v_proj], [self.heads, self.kv_heads, None])
        bias = None
        if base_layer(attn.q_proj).bias is not None:
            q_bias, k_bias, v_bias = (base_layer(p).bias for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            joined = torch.cat([interleave_pairs(q_bias, self.heads), interleave_pairs(k_bias, self.kv_heads), v_bias])
            bias = self._buffer(f"{index}.qkv_bias", tuple(joined.shape), joined).copy_(joined)
        return FusedLayer(
            in_norm=self._own(f"{index}.in_norm", layer.input_layernorm.weight),
            qkv=qkv,
            qkv_bias=bias,
            o=self._projection(f"{index}.o", attn.o_proj),
            post_norm=self._own(f"{index}.post_norm", layer.post_attention_layernorm.weight),
            gate_up=self._stack(f"{index}.gate_up", [mlp.gate_proj, mlp.up_proj], [None, None]),
            down=self._projection(f"{index}.down", mlp.down_proj),
        )

    def _stack(self, name: str, projections: list[nn.Module], heads: list[int | None]) -> Tensor:
        """The effective weights of ``projections`` one above the other, each written once into
        its rows of one matrix (q and k rows pair-interleaved: ``heads`` not None)."""
        weights = [base_layer(p).weight for p in projections]
        rows = [w.shape[0] for w in weights]
        stacked = self._buffer(name, (sum(rows), weights[0].shape[1]), weights[0])
        for projection, part, n_heads in zip(projections, stacked.split(rows), heads, strict=True):
            effective_weight(projection, out=part, heads=n_heads)
        return stacked

    def weight_pointers(self) -> tuple[int, ...]:
        """Where every tensor a decoding step reads lives: a captured step is valid while these hold."""
        tensors = [self.embed, self.final_norm, self.lm_head]
        tensors += [t for layer in self.layers for t in layer if t is not None]
        return tuple(t.data_ptr() for t in tensors)

    def _fingerprint(self) -> tuple[list[tuple[Tensor, int, int]], list[tuple]]:
        # a parameter's version counts in-place writes (optimizer steps, load_state_dict);
        # its data pointer changes when it is moved or replaced through ``.data``. The LoRA
        # matrices are parameters of the wrapped module too. What else decides a LoRA layer's
        # output is plain Python state: enabled or not, which adapters are active or merged
        # (a merge writes through ``.data``, so it shows here and not in the versions), scaling.
        params = [(p, p._version, p.data_ptr()) for p in self.causal_lm.parameters()]
        adapters = [
            (p.disable_adapters, tuple(p.active_adapters), tuple(p.merged_adapters), tuple(p.scaling.items()))
            for p in self._lora_layers
        ]
        return params, adapters

    def refresh_if_changed(self) -> None:
        """Re-fuse when any parameter was written or replaced, or a LoRA layer switched its
        adapters (on/off, active, merged, scaling), since the last fuse."""
        if not self.same_weights(self._sources):
            self.refresh()

    def weights_mark(self) -> object:
        """What the weights are now (versions, places, adapter state): :meth:`same_weights` of it
        later says whether keys and values computed now are still theirs."""
        return self._fingerprint()

    def same_weights(self, mark: object) -> bool:
        (current, adapters), (sources, earlier_adapters) = self._fingerprint(), mark  # type: ignore[misc]
        same = adapters == earlier_adapters and len(current) == len(sources)
        return same and all(
            a is b and va == vb and pa == pb for (a, va, pa), (b, vb, pb) in zip(current, sources, strict=True)
        )

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

    def _mlp(self, hidden: Tensor, w: FusedLayer, product: Callable[..., Tensor] = linear) -> Tensor:
        """``hidden + down(silu(gate(x)) · up(x))`` with ``x = RMSNorm(hidden)``, for ``[N, H]``;
        ``product(x, weight, residual=None)`` multiplies (a decoding step's: ``self.products``)."""
        x = F.rms_norm(hidden, (self.hidden,), w.post_norm, self.eps)
        gate, up = product(x, w.gate_up).chunk(2, dim=-1)
        return product(F.silu(gate).mul_(up), w.down, residual=hidden)

    def _pack_for(self, rows: int) -> None:
        """Pack the step's weights for ``rows``-row products when the steps left repay it."""
        if self.products.rows == rows:
            return
        left = self.step_rotations.shape[1] - 1 - self.step  # decode calls left, this one included
        self.products.clear()  # a pack serves one row count only
        if rows * left >= PACK_FROM_ROW_STEPS:
            self.products.pack(self._step_weights(), rows)

    def _step_weights(self) -> list[Tensor]:
        """What a decoding step multiplies by: each layer's projections, the output layer's slices."""
        chunks = [self.lm_head[s : s + self.LOGIT_CHUNK] for s in range(0, self.lm_head.shape[0], self.LOGIT_CHUNK)]
        return [t for w in self.layers for t in (w.qkv, w.o, w.gate_up, w.down)] + chunks

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        max_new_tokens: int,
        repeats: int = 1,
        cache: tuple[Tensor, Tensor] | None = None,
        reuse: Reuse | None = None,
    ) -> Tensor:
        """Start a batch of left-padded prompts ``input_ids [U, P]`` (``attention_mask [U, P]``,
        1 on real tokens), each continued ``repeats`` times: every prompt is encoded once and
        its keys and values are written into the cache rows of all its samples. Returns the
        next-token logits ``[U·repeats, V]``, prompt-major.

        ``cache``: keys and values ``[layers, ≥ U·repeats, kv_heads, capacity, D]`` to write into
        (a fixed-shape decoder's, capacity ≥ P + max_new_tokens); by default one is allocated.
        ``reuse``: keys and values of each prompt's first tokens, computed before (``repeats`` 1;
        rollout/turn_cache.py): only the tokens after them are encoded."""
        self.refresh_if_changed()
        lengths = None if reuse is None else reuse.lengths.to(input_ids.device)
        input_ids, valid, reused, shared = lay_out(input_ids, attention_mask.bool(), lengths, self.MIN_SHARED)
        prompts, length = input_ids.shape
        batch = prompts * repeats
        dtype, device = self.embed.dtype, self.embed.device
        capacity = self._take_cache(batch, length + max_new_tokens, cache)
        if reuse is not None:
            self._write_reused(reuse, reused)
        start = shared or reused  # the first column the layers encode
        self.prefilled_tokens = shared + int(valid[:, start:].sum())
        self.real_columns = valid.repeat_interleave(repeats, 0)  # each row's, for kept_rows
        positions = valid.long().cumsum(-1).sub_(1).clamp_(min=0)
        # decoding step t of a row sits at position (real prompt tokens) + t
        steps = positions[:, -1:] + 1 + torch.arange(max_new_tokens, device=positions.device)
        self.step_rotations = self._rotations(steps).repeat_interleave(repeats, 0).unsqueeze(2)  # [B, T, 1, D/2]
        self.length, self.step = length, 0
        # additive masks with a finite minimum: a padding query then attends uniformly
        # (finite) instead of to nothing (NaN) — its output is never read
        minimum = torch.finfo(dtype).min
        self.decode_bias = torch.zeros(batch, 1, 1, capacity, dtype=dtype, device=device)
        self.decode_bias[..., :length].masked_fill_(~self.real_columns[:, None, None], minimum)
        causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
        allowed = causal & valid[:, None, None, :]  # [U, 1, P, P]
        bias = torch.full(allowed.shape, minimum, dtype=dtype, device=valid.device).masked_fill_(allowed, 0.0)
        rotations = self._rotations(positions).unsqueeze(2)
        if shared:  # the shared prefix encoded once, its keys and values written into every row
            self._prefill_layers(self.embed[input_ids[:1, :shared]], rotations[:1, :shared],
                                 bias[:1, :, :shared, :shared], prompts * repeats)  # fmt: skip
        hidden = self._prefill_layers(
            self.embed[input_ids[:, start:]], rotations[:, start:], bias[:, :, start:], repeats, start=start
        )
        logits = F.linear(F.rms_norm(hidden, (self.hidden,), self.final_norm, self.eps), self.lm_head)
        if cache is None:  # decode's logits go to the same memory every step (see SamplingWorkspace for why)
            vocab = self.lm_head.shape[0]
            self.logits = torch.empty(batch, vocab, dtype=logits.dtype, device=logits.device)
            self.logits_t = torch.empty(min(vocab, self.LOGIT_CHUNK) * batch, dtype=logits.dtype, device=logits.device)
        return logits.repeat_interleave(repeats, 0)

    def _take_cache(self, batch: int, width: int, cache: tuple[Tensor, Tensor] | None) -> int:
        """The batch's keys and values: ``cache``'s first rows, else new ones ``width`` wide; their capacity."""
        if cache is None:
            # empty, not zeros: attention only reads positions already written
            shape = (len(self.layers), batch, self.kv_heads, width, self.head_dim)
            self.keys = torch.empty(shape, dtype=self.embed.dtype, device=self.embed.device)
            self.values = torch.empty(shape, dtype=self.embed.dtype, device=self.embed.device)
        else:
            self.keys, self.values = cache[0][:, :batch], cache[1][:, :batch]
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)
        return self.keys.shape[-2]

    def _prefill_layers(self, hidden: Tensor, rotations: Tensor, bias: Tensor, repeats: int, start: int = 0) -> Tensor:
        """Run the layers on ``hidden [U, P, H]``, the prompts' positions from ``start`` on (those
        before are in the cache already: a shared prefix); return the last position's output ``[U, H]``.

        The last layer needs keys and values everywhere but its output only at the last
        position, so its attention and MLP run on that position alone.
        """
        prompts, length, _ = hidden.shape
        end = start + length
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        for index, w in enumerate(self.layers):
            x = F.rms_norm(hidden, (self.hidden,), w.in_norm, self.eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)  # [U, P, (h + 2kv)·d]
            qk = rotate_pairs(qkv[..., : (h + kv) * d].unflatten(-1, (h + kv, d)), rotations).transpose(1, 2)
            q, k = qk[:, :h], qk[:, h:]  # [U, heads, P, d]
            v = qkv[..., (h + kv) * d :].unflatten(-1, (kv, d)).transpose(1, 2)
            # every sample of a prompt starts from the same keys and values
            grouped = (prompts, repeats, kv, self.keys.shape[-2], d)
            self.keys[index].view(grouped)[..., start:end, :] = k.unsqueeze(1)
            self.values[index].view(grouped)[..., start:end, :] = v.unsqueeze(1)
            if start:  # attend to the prefix too: each prompt's first sample's row holds it all
                k = self.keys[index].view(grouped)[:, 0, :, :end]
                v = self.values[index].view(grouped)[:, 0, :, :end]
            last = index == len(self.layers) - 1
            if last:
                q, bias, hidden = q[:, :, -1:], bias[:, :, -1:], hidden[:, -1:]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=kv != h)  # [U, h, P|1, d]
            attn = attn.transpose(1, 2).flatten(2)
            hidden = linear(attn.flatten(0, 1), w.o, residual=hidden.flatten(0, 1))
            hidden = self._mlp(hidden, w).unflatten(0, (prompts, -1))
        return hidden[:, -1]

    # ---- decode ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, tokens: Tensor) -> Tensor:
        """Append one token per row ``tokens [B]``; return the next-token logits ``[B, V]``."""
        end = self.length + 1
        batch, kv, group = tokens.shape[0], self.kv_heads, self.heads // self.kv_heads
        bias = self.decode_bias[..., :end].expand(batch, kv, group, end).reshape(batch * kv, group, end)
        rotations = self.step_rotations[:, self.step]  # [B, 1, D/2]
        if self.products.packing:
            self._pack_for(batch)
        hidden = F.embedding(tokens, self.embed)  # [B, H]
        for w, keys, values in zip(self.layers, self.layer_keys, self.layer_values, strict=True):
            hidden = self.decode_layer(hidden, w, keys, values, rotations, bias, self.length, self.products)
        self.length, self.step = end, self.step + 1
        return self._output_logits(F.rms_norm(hidden, (self.hidden,), self.final_norm, self.eps))

    def decode_at(
        self,
        tokens: Tensor,
        keys: Sequence[Tensor],
        values: Sequence[Tensor],
        bias: Tensor,
        rotations: Tensor,
        slot: Tensor,
        product: Callable[..., Tensor] | None = None,
        layer: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        """One decoding step over fixed shapes (static_decode.py), for a step captured as a CUDA
        graph or compiled: the token of each row ``tokens [B]`` goes to cache position ``slot``
        (a one-element long tensor, so no Python number changes from step to step) of each
        layer's ``keys``/``values [B, kv, C, D]``; attention covers the ``span`` positions of
        ``bias [B, 1, 1, span]`` (span > slot), which masks those not written yet; ``rotations``
        ``[B, 1, D/2]`` complex or ``[B, 1, D/2, 2]`` real (see ``rotary.rotate_pairs``). ``product``: how to
        multiply (by default the decoder's), ``layer``: what runs a layer (by default
        :meth:`decode_layer`; a compiled step passes it compiled). Returns new logits ``[B, V]``."""
        batch, kv, group, span = tokens.shape[0], self.kv_heads, self.heads // self.kv_heads, bias.shape[-1]
        bias = bias.expand(batch, kv, group, span).reshape(batch * kv, group, span)
        layer, product = layer or NativeDecoder.decode_layer, product or self.products
        hidden = F.embedding(tokens, self.embed)  # [B, H]
        for w, layer_keys, layer_values in zip(self.layers, keys, values, strict=True):
            hidden = layer(self, hidden, w, layer_keys, layer_values, rotations, bias, slot, product)
        return F.linear(F.rms_norm(hidden, (self.hidden,), self.final_norm, self.eps), self.lm_head)

    def decode_layer(
        self,
        hidden: Tensor,
        w: FusedLayer,
        keys: Tensor,
        values: Tensor,
        rotations: Tensor,
        bias: Tensor,
        at: int | Tensor,
        product: Callable[..., Tensor],
    ) -> Tensor:
        """One layer on one new token per row ``hidden [B, H]``: its keys and values written at
        cache position ``at`` of ``keys``/``values [B, kv, C, D]``, attention over the first ``end``
        positions with additive ``bias [B·kv, group, end]``. A compiled step compiles this: one
        graph serves every layer (static_decode.py)."""
        batch, h, kv, d, end = hidden.shape[0], self.heads, self.kv_heads, self.head_dim, bias.shape[-1]
        x = F.rms_norm(hidden, (self.hidden,), w.in_norm, self.eps)
        qkv = product(x, w.qkv)  # [B, (h + 2kv)·d]
        if w.qkv_bias is not None:
            qkv += w.qkv_bias
        qk = rotate_pairs(qkv[:, : (h + kv) * d].unflatten(-1, (h + kv, d)), rotations)
        new_values = qkv[:, (h + kv) * d :].unflatten(-1, (kv, d))
        if isinstance(at, int):
            keys.select(2, at).copy_(qk[:, h:])
            values.select(2, at).copy_(new_values)
        else:  # a position held on the device
            keys.index_copy_(2, at, qk[:, h:].unsqueeze(2))
            values.index_copy_(2, at, new_values.unsqueeze(2))
        # one query per row: attention is a batch of [group, d] @ [d, S] products, one per
        # (row, kv head), written out with baddbmm/bmm (cheaper here than SDPA's kernel)
        queries = qk[:, :h].reshape(batch * kv, h // kv, d)
        scores = torch.baddbmm(bias, queries, keys[:, :, :end].flatten(0, 1).transpose(1, 2), alpha=self.scale)
        attn = torch.bmm(torch.softmax(scores, dim=-1), values[:, :, :end].flatten(0, 1))  # [B·kv, group, d]
        hidden = product(attn.view(batch, h * d), w.o, residual=hidden)
        return self._mlp(hidden, w, product)

    def _output_logits(self, x: Tensor) -> Tensor:
        """``x [B, H] @ lm_headᵀ`` into the reused buffer ``self.logits[:B]``."""
        logits = self.logits[: x.shape[0]]
        return self.products.logits(x, self.lm_head, logits, self.logits_t, self.LOGIT_CHUNK)

    def release(self, keep_weights: bool = False) -> int:
        """Free what generation holds between batches: the KV cache, the step buffers and the
        derived weights (copies; the next ``prefill`` derives them from the weights as they are
        then) unless ``keep_weights`` (a captured step reads them). In an RL step the update runs
        in between, so this memory is the update's (SmolLM2-135M with LoRA: 0.43 GB of fused
        weights, and 0.9 GB of cache after a 50-prompt evaluation). Returns about how many bytes
        that was."""
        model_weights = {p.data_ptr() for p in self.causal_lm.parameters()}
        held = [
            t for t in (getattr(self, name, None) for name in ("keys", "values", "logits", "logits_t")) if t is not None
        ]
        if not keep_weights:
            held += list(self._copies.values())
        freed = sum(t.untyped_storage().nbytes() for t in held if t.data_ptr() not in model_weights)
        self.keys = self.values = self.logits = self.logits_t = None
        self.products.clear()
        self.layer_keys = self.layer_values = ()
        self.step_rotations = self.decode_bias = self.real_columns = None
        if not keep_weights:
            self.layers, self._copies = [], {}
            self._sources = ([], [])  # matches no model: the next prefill derives the weights again
        return freed

    def _write_reused(self, reuse: Reuse, width: int) -> None:
        """Row b's kept keys and values into its first ``reuse.lengths[b]`` cache columns, zeros
        up to ``width``: masked columns nothing else writes (a masked weight is 0, but 0 × the
        NaN that unwritten memory may hold is NaN)."""
        for row, (n, keys, values) in enumerate(zip(reuse.lengths.tolist(), reuse.keys, reuse.values, strict=True)):
            if n:
                self.keys[:, row, :, :n] = keys[:, :, :n]
                self.values[:, row, :, :n] = values[:, :, :n]
            self.keys[:, row, :, n:width] = 0
            self.values[:, row, :, n:width] = 0

    def kept_rows(self, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Copies of the keys and values the cache rows ``rows`` hold for their real tokens in
        order — the prompt's, then every token decoded so far: ``[layers, kv heads, n, D]``."""
        decoded = torch.arange(self.real_columns.shape[1], self.length, device=self.keys.device)
        kept = []
        for row in rows.tolist():
            columns = torch.cat([self.real_columns[row].nonzero().flatten(), decoded])
            kept.append((self.keys[:, row].index_select(2, columns), self.values[:, row].index_select(2, columns)))
        return kept

    @torch.inference_mode()
    def select(self, rows: Tensor) -> None:
        """Keep only the running rows ``rows [B']`` (finished ones are dropped).

        Only the positions written so far are copied: the rest of the cache was never touched,
        so the system has not given it memory yet. Rows in ascending order (as the engine drops
        finished ones) move to the front of the cache in place; indexing would build a second
        cache while the first is alive, the peak memory of a long evaluation (50 SmolLM2 rows)."""
        kept, written = rows.tolist(), self.length
        if all(a < b for a, b in itertools.pairwise(kept)):
            # row new ≤ old, and every later source lies beyond it: nothing is overwritten before it is read
            for new, old in enumerate(kept):
                if new != old:
                    self.keys[:, new, :, :written].copy_(self.keys[:, old, :, :written])
                    self.values[:, new, :, :written].copy_(self.values[:, old, :, :written])
            self.keys, self.values = self.keys[:, : len(kept)], self.values[:, : len(kept)]
        else:
            shape = (self.keys.shape[0], len(kept), *self.keys.shape[2:])
            keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
            keys[:, :, :, :written] = self.keys[:, rows, :, :written]
            values[:, :, :, :written] = self.values[:, rows, :, :written]
            self.keys, self.values = keys, values
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)
        self.step_rotations, self.decode_bias = self.step_rotations[rows], self.decode_bias[rows]
        self.real_columns = self.real_columns[rows]
