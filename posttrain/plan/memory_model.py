"""How much memory a run needs, phase by phase, from the shapes alone (no weights loaded).

The model's shape comes from its config (``ModelShape``); the run's sizes (rows per pass,
sequence lengths, what is trained) from the resolved config. Every figure is a sum of tensors
the run really holds, in bytes; the formulas:

* weights ``N·p`` (``N`` parameters, ``p`` bytes each); a decoder layer has
  ``H·(h + 2k)·d + h·d·H`` attention and ``3·H·I`` MLP weights, plus two norms;
* gradients ``N_t·p`` and AdamW's two moments ``2·N_t·p`` for the ``N_t`` trained parameters
  (all of them, or LoRA's ``r·(in + out)`` per adapted linear layer);
* KV cache ``2·L·B·k·d·S·p`` for ``B`` sequences of ``S`` positions;
* activations kept for the backward pass, per token and layer ``(12·H + 4·I)·a`` bytes (``a``:
  the activations' bytes). Counted with autograd's saved-tensor hooks on llama and qwen2 layers
  (``tests/plan/test_memory_model.py``): the norms' inputs, q/k/v, the rotated q/k, the
  attention output (PyTorch's fused attention keeps no ``T × T`` scores), the MLP's
  gate/up/product. With gradient checkpointing each layer keeps its input ``H·a`` and one layer's
  full set is rebuilt at a time in the backward pass;
* logits ``[rows, T, V]`` in the activations' dtype and their gradient; log-softmax runs in
  float32 chunks of at most ``CHUNK_ELEMENTS`` (``models/logprobs.py``). RL passes of a model
  whose logits are its head's output (and not sharded) never hold the logits: the head runs a
  chunk of positions at a time, recomputed in the backward pass.

The same figures size the default micro-batch (``micro_batch_tokens``) and print as
``posttrain ... --plan``; ``benchmarks/memory_plan.py`` compares them with measured peaks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.models.logprobs import CHUNK_ELEMENTS, LOGIT_TRANSFORMS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each the parameter's shape and dtype
SAVED_PER_HIDDEN, SAVED_PER_INTERMEDIATE = 12, 4  # activations kept per token and layer, in units of H and I
TRANSIENT_PER_HIDDEN, TRANSIENT_PER_INTERMEDIATE = 6, 3  # one layer's temporaries without autograd


REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers")


class ShapeUnknown(ValueError):
    """A model config the plan cannot read its sizes from; the message says which are missing."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a llama-like decoder that memory depends on."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool = False
    plain_head: bool = True  # logits exactly head(hidden): RL passes run the head chunk by chunk

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (its attributes, so every family's names: GPT-2's ``n_embd`` is
        its ``hidden_size``) or a ``config.json``'s keys (llama, qwen2, mistral, ... names). A config
        without the sizes every decoder has is :class:`ShapeUnknown`, naming the missing one."""
        if isinstance(config, Mapping):
            get = config.get
        else:

            def get(key: str, default: Any = None) -> Any:
                return getattr(config, key, default)

        missing = [key for key in REQUIRED_SIZES if not isinstance(get(key), int) or isinstance(get(key), bool)]
        if missing:
            raise ShapeUnknown(f"its config has no whole-number {', '.join(missing)}")
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        return cls(
            vocab=get("vocab_size"),
            hidden=hidden,
            layers=get("num_hidden_layers"),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate=int(get("intermediate_size") or 4 * hidden),
            tied=bool(get("tie_word_embeddings", False)),
            qkv_bias=bool(get("attention_bias", False)) or get("model_type") == "qwen2",
            plain_head=all(get(key) in (None, 1, 1.0) for key in LOGIT_TRANSFORMS),
        )

    def linear_layers(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's linear layers: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def parameters(self) -> int:
        """Every weight of the causal LM (embeddings, layers, final norm, output layer)."""
        per_layer = sum(a * b for a, b in self.linear_layers()) + 2 * self.hidden
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * per_layer + self.hidden

    def lora_parameters(self, rank: int) -> int:
        """LoRA's A and B matrices on every linear layer of the decoder (``all-linear``)."""
        return self.layers * sum(rank * (a + b) for a, b in self.linear_layers())

    def kv_cache(self, rows: int, positions: int, nbytes: int) -> int:
        return 2 * self.layers * rows * self.kv_heads * self.head_dim * positions * nbytes

    def engine_copies(self, nbytes: int, lora: bool) -> int:
        """The native engine's fused weights (q|k|v and gate|up per layer; o and down too when
        adapters are merged into them), rebuilt for each generation and freed after it."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        per_layer = h * (q + 2 * kv) + 2 * h * i + ((q * h + i * h) if lora else 0)
        return self.layers * per_layer * nbytes

    def engine_packs(self) -> int:
        """MKL's packed float32 copies of every projection and the output layer, which the
        native engine makes on a CPU for a batch long enough to repay them (rollout/products.py)."""
        return (self.layers * sum(a * b for a, b in self.linear_layers()) + self.vocab * self.hidden) * 4

    def saved_activations(self, tokens: int, nbytes: int, checkpointing: bool) -> int:
        """What a forward pass under autograd keeps for the backward pass, ``tokens`` = rows × T."""
        layer = (SAVED_PER_HIDDEN * self.hidden + SAVED_PER_INTERMEDIATE * self.intermediate) * tokens * nbytes
        if not checkpointing:
            return self.layers * layer
        return (self.layers + 2) * self.hidden * tokens * nbytes + layer  # inputs kept, one layer rebuilt

    def layer_temporaries(self, tokens: int, nbytes: int) -> int:
        """One layer's intermediate tensors in a forward pass without autograd."""
        return (TRANSIENT_PER_HIDDEN * self.hidden + TRANSIENT_PER_INTERMEDIATE * self.intermediate) * tokens * nbytes


def logits_bytes(
    rows: int, positions: int, vocab: int, nbytes: int, with_gradient: bool, chunked_head: bool = False
) -> int:
    """The output layer's ``[rows, positions, V]`` logits, one float32 log-softmax chunk (three
    ``[chunk, V]`` temporaries) and, under autograd, the logits' gradient. With
    ``chunked_head`` (the head run chunk by chunk over the hidden states) no ``[rows, positions,
    V]`` tensor exists: a chunk's three temporaries, and in the backward pass its recomputed
    logits, log-softmax and their two gradients."""
    chunk = min(CHUNK_ELEMENTS, rows * positions * vocab) * 4
    if chunked_head:
        return chunk * (5 if with_gradient else 3)
    logits = rows * positions * vocab * nbytes
    return logits * (2 if with_gradient else 1) + 3 * chunk


@dataclass
class Phase:
    """One phase of a run (generation, log-probs, update, ...): what it adds on top of what
    every phase holds, as named parts in bytes."""

    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryPlan:
    """What every phase holds (``resident``), each phase's additions, and the peak."""

    resident: Phase
    phases: list[Phase]
    runtime: int = 0  # the process itself (interpreter, libraries): measured, not modelled
    # what a phase's short-lived tensors really cost: on the CPU the C allocator keeps much of
    # what a pass frees (posttrain/memory.py), so the resident size grows past the live tensors
    transient_factor: float = 1.0

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def peak(self) -> int:
        phase = self.peak_phase.total if self.phases else 0
        return self.runtime + self.resident.total + round(phase * self.transient_factor)


def human(count: float) -> str:
    """Bytes as MiB below 1 GiB, GiB from there."""
    if 0 < count < 2**19:
        return "<1 MiB"
    return f"{count / 2**20:.0f} MiB" if count < 2**30 else f"{count / 2**30:.2f} GiB"


def plan_lines(plan: MemoryPlan, device: str, available: int | None) -> list[str]:
    """The plan as printed: every phase with its parts, then the peak against the device."""
    lines = []
    if plan.runtime:
        lines.append(f"  {'runtime':<13} {human(plan.runtime):>11}  (this process: interpreter and libraries)")
    lines.append(f"  {'resident':<13} {human(plan.resident.total):>11}  ({_parts(plan.resident)})")
    for phase in plan.phases:
        lines.append(f"  {phase.name:<13} {'+' + human(phase.total):>11}  ({_parts(phase)})")
    where = f" of the {human(available)} {device}" if available else ""
    kept = f" (phases ×{plan.transient_factor:g}, measured: what a pass takes beyond the tensors listed)"
    kept = kept if plan.transient_factor != 1 else ""
    lines.append(f"  {'peak':<13} {human(plan.peak):>11}{where}, in the {plan.peak_phase.name}{kept}")
    return lines


def _parts(phase: Phase) -> str:
    return ", ".join(f"{name} {human(count)}" for name, count in phase.parts.items() if count) or "nothing"
