"""Padding-free passes: a micro-batch's sequences laid end to end in one row, each attending only
to itself.

A padded batch of prompts and responses computes every position of a ``[B, P + T]`` rectangle
and, for the padding, a ``[B, 1, L, L]`` attention mask; responses of an RL batch differ in length
(a few tokens to ``max_new_tokens``), so much of that rectangle is padding. Here the real tokens of
every sample — its prompt without the left padding, its response up to the last attended token —
are concatenated into one row of N = Σ L_b tokens with position ids restarting at 0 for each
sample, and attention is causal *within* each sample (the document mask of TRL's ``padding_free``
and verl's ``use_remove_padding``, there through flash-attention's varlen kernel):

- a CUDA device: PyTorch's scaled-dot-product attention on nested (jagged) tensors, whose flash
  and memory-efficient kernels take the documents' offsets and never build a mask;
- elsewhere (the CPU has no jagged kernel): one causal attention call per document.

The attention is a transformers attention function registered under :data:`PACKED_ATTENTION`
(``AttentionInterface``): a forward given ``cu_seq_lens_q`` (the documents' offsets) attends per
document; any other forward of the same model goes to the implementation it had before, so
generation, prompt caches and padded passes are unchanged. Only the positions that predict a
response token reach the output layer (chunk by chunk, ``models/logprobs.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.errors import PosttrainError
from posttrain.models.logprobs import chunked_logprobs, output_layer

PACKED_ATTENTION = "posttrain_packed"


class PackingUnsupported(PosttrainError, ValueError):
    """A model whose attention cannot be limited to each packed sample."""


@dataclass(frozen=True)
class PackedRow:
    """Sequences laid end to end: ``input_ids`` and ``position_ids`` ``[1, N]``, the documents'
    ``offsets [S + 1]`` and ``bounds``, and for every token to score the flat position whose
    output predicts it (``predictors``) and the token (``targets``)."""

    input_ids: Tensor
    position_ids: Tensor
    offsets: Tensor
    bounds: tuple[tuple[int, int], ...]
    predictors: Tensor
    targets: Tensor

    def forward_kwargs(self) -> dict[str, Any]:
        """What a transformers forward of the row takes: ids, positions, and the documents that
        :func:`packed_attention` reads (``cu_seq_lens_q``: flash-attention's own keyword)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
            "cu_seq_lens_q": self.offsets,
            "max_length_q": max((end - start for start, end in self.bounds), default=0),
            "document_bounds": self.bounds,
        }


def packed_row(ids: Tensor, lengths: Tensor, predictors: Tensor) -> PackedRow:
    """The row of the documents ``ids [N]`` (their ``lengths [S]`` in order) scoring the tokens
    after each of ``predictors [M]`` (flat positions)."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = lengths.cumsum(0)
    positions = torch.arange(ids.numel(), device=ids.device) - offsets[:-1].repeat_interleave(lengths)
    bounds = tuple(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    return PackedRow(ids[None], positions[None], offsets, bounds, predictors, ids[predictors + 1])


def pack_samples(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, widths: Tensor
) -> tuple[PackedRow, Tensor, Tensor]:
    """One row holding, per sample b, its prompt's real tokens (``prompt_mask`` 1; prompts are
    left-padded) then its first ``widths[b]`` response tokens (responses are right-padded),
    scoring every response token; with the (row, column) of each scored token in ``[B, T]``."""
    prompt_lengths = prompt_mask.long().sum(1)
    lengths = prompt_lengths + widths
    starts = lengths.cumsum(0) - lengths
    in_response = torch.arange(response_ids.shape[1], device=response_ids.device)[None, :] < widths[:, None]
    prompt_at = _ranges(starts, prompt_lengths)
    response_at = _ranges(starts + prompt_lengths, widths)
    ids = torch.empty(int(lengths.sum()), dtype=prompt_ids.dtype, device=prompt_ids.device)
    ids[prompt_at] = prompt_ids[prompt_mask.bool()]  # row-major: each sample's tokens in order
    ids[response_at] = response_ids[in_response]
    rows, columns = in_response.nonzero(as_tuple=True)
    return packed_row(ids, lengths, response_at - 1), rows, columns  # the position before a token predicts it


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))`` without a Python loop."""
    total = int(lengths.sum())
    first = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
    return first + torch.arange(total, device=starts.device)


def check_packable(model_path: str | None, key: str) -> None:
    """Before a model loads: refuse ``key`` (padding_free, packing) for a model folder whose class
    computes its own attention (Bloom), read from its config; the tiny models always pack."""
    if model_path is None:
        return
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from posttrain.models.loading import read_config

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(read_config(model_path).model_type)
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        raise PackingUnsupported(
            f"{key}: {name} computes its own attention, so samples laid end to end would attend to each other; "
            f"set {key}: false"
        )


def use_packed_attention(model: nn.Module) -> None:
    """Switch ``model`` (or the model a PEFT wrapper holds) to :func:`packed_attention`, once;
    unpacked forwards keep going to the implementation it had."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    current = base.config._attn_implementation
    if current == PACKED_ATTENTION:
        return
    if not getattr(base, "_supports_attention_backend", False):  # its attention takes no function of ours
        raise PackingUnsupported(
            f"padding_free / packing: {type(base).__name__} computes its own attention, so samples laid end to end "
            "would attend to each other; train it with padding_free: false (packing: false for SFT)"
        )
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
    for config in {id(m.config): m.config for m in base.modules() if hasattr(m, "config")}.values():
        _UNPACKED[id(config)] = (weakref.ref(config), getattr(config, "_attn_implementation", None) or current)
    base.set_attn_implementation(PACKED_ATTENTION)


# the implementation each switched config had, kept here rather than on the config (whose
# attributes save_pretrained writes into config.json): id → (the config, weakly; its name)
_UNPACKED: dict[int, tuple[weakref.ref, str]] = {}


def _previous(config: Any) -> str:
    """The attention implementation ``config`` had before :func:`use_packed_attention`."""
    held, name = _UNPACKED.get(id(config), (None, "sdpa"))
    return name if held is not None and held() is config else "sdpa"


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function: ``query [1, H, N, D]``, ``key, value [1, kv, N, D]`` of
    one packed row → ``[1, N, H, D]``, causal within each document of ``document_bounds``. Without
    them (an unpacked forward), the model's previous attention implementation."""
    bounds = kwargs.get("document_bounds")
    if bounds is None:
        return _unpacked(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    window = _window(module)
    longest = kwargs.get("max_length_q") or max(end - start for start, end in bounds)
    if query.device.type == "cuda" and (window is None or longest <= window):
        out = _jagged_attention(query, key, value, kwargs["cu_seq_lens_q"], longest, scaling)
    else:
        out = _per_document(query, key, value, bounds, scaling, window)
    return out, None


def _window(module: nn.Module) -> int | None:
    """The sliding window this layer attends within: its own attribute (Qwen2, per layer), else the
    config's — Mistral applies its window through the attention mask alone, which a packed pass
    does not build — for a layer the config's ``layer_types`` does not mark as full attention."""
    window = getattr(module, "sliding_window", None)
    if window is not None:
        return window
    config = getattr(module, "config", None)
    types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if types is not None and layer is not None and types[layer] != "sliding_attention":
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def _unpacked(module: nn.Module) -> Any:
    """The attention function the model had (a model-specific ``eager`` one is not in the shared
    registry: SDPA, which computes the same attention, stands in for it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _previous(module.config)
    return ALL_ATTENTION_FUNCTIONS[name if name in ALL_ATTENTION_FUNCTIONS else "sdpa"]


def _per_document(
    query: Tensor, key: Tensor, value: Tensor, bounds: Any, scaling: float | None, window: int | None
) -> Tensor:
    """One causal attention call per document (a band mask where a sliding window cuts it)."""
    outputs = []
    for start, end in bounds:
        length = end - start
        mask = None
        if window is not None and length > window:
            at = torch.arange(length, device=query.device)
            mask = (at[:, None] >= at[None, :]) & (at[:, None] - at[None, :] < window)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _jagged_attention(
    query: Tensor, key: Tensor, value: Tensor, offsets: Tensor, longest: int, scaling: float | None
) -> Tensor:
    """Causal attention over nested (jagged) tensors: the documents' offsets go to the flash or
    memory-efficient kernel, no mask is built."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # jagged attention takes no grouped-query layout
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    offsets = offsets.long()

    def jagged(x: Tensor) -> Tensor:  # [1, h, N, D] → [S, h, (j), D]
        values = x[0].transpose(0, 1).contiguous()
        return torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=longest).transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(query), jagged(key), jagged(value), is_causal=True, scale=scaling)
    return out.transpose(1, 2).values().unsqueeze(0)


def _packed_mask(**kwargs: Any) -> Tensor | None:
    """The mask of a forward under :data:`PACKED_ATTENTION`: none for a packed row (given no
    padding mask; :func:`packed_attention` keeps documents apart), else what the model's previous
    implementation would build."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    square = kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("kv_offset")
    if kwargs.get("attention_mask") is None and square and not kwargs.get("local_size"):
        return None
    name = _previous(kwargs.get("config"))
    return ALL_MASK_ATTENTION_FUNCTIONS[name if name in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"](**kwargs)


def packed_token_logprobs(
    model: nn.Module,
    packed: PackedRow,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``[M]`` float32 log-probs (and entropies) of ``packed.targets`` from one pass over the row;
    only the predicting positions reach the output layer, a chunk at a time. ``support [M, K]``:
    each target's kept set (:func:`~posttrain.models.logprobs.chunked_logprobs`)."""
    use_packed_attention(model)
    inputs, head = packed.forward_kwargs(), output_layer(model)
    if head is not None:
        hidden = model.get_decoder()(**inputs).last_hidden_state[0, packed.predictors]
        return chunked_logprobs(
            hidden, packed.targets, head, head.weight.shape[0], temperature, chunk_size, with_entropy, support=support
        )
    logits = model(**inputs, logits_to_keep=packed.predictors).logits[0]
    return chunked_logprobs(
        logits, packed.targets, nn.Identity(), logits.shape[-1], temperature, chunk_size, with_entropy, support=support
    )


def packed_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    widths: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`~posttrain.models.logprobs.response_logprobs` of ``prompt ‖ response`` samples from
    one padding-free pass: ``prompt_ids, prompt_mask [B, P]`` left-padded, ``response_ids,
    response_mask [B, T]`` right-padded, ``widths [B]`` each response's attended tokens (its
    environment turns included). Returns ``[B, T]`` float32 log-probs (and entropies), 0 where
    ``response_mask`` is 0; equal to the padded pass up to float rounding. ``support [B, T, K]``:
    each response token's kept set, renormalised over."""
    packed, rows, columns = pack_samples(prompt_ids, prompt_mask, response_ids, widths)
    logprobs, entropies = packed_token_logprobs(
        model, packed, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size,
        support=None if support is None else support[rows, columns],
    )  # fmt: skip
    blank = torch.zeros(response_ids.shape, dtype=torch.float32, device=response_ids.device)
    out = blank.index_put((rows, columns), logprobs) * response_mask
    return out, None if entropies is None else blank.index_put((rows, columns), entropies) * response_mask
