"""Log-probabilities (and entropies) of the tokens a sequence actually contains.

Every loss in posttrain (SFT, the policy losses, KL to a reference) starts from these. With a
real vocabulary (~150k) a full ``[B, T, V]`` float32 log-softmax is the largest tensor of a
training step, so it is computed chunk by chunk: per chunk of positions, one float32 upcast,
one log-softmax and one gather. Under autograd each chunk is checkpointed (recomputed in the
backward pass), so the backward pass holds one chunk's ``[rows, V]`` float32 tensors at a
time too, not all of them. ``response_logprobs(..., lm_head_chunks=True)`` and
:func:`shared_prompt_logprobs` (wherever :func:`output_layer` finds a plain one) go one step
further and never build the response's ``[B, T, V]`` logits at all: the decoder's hidden states
go through the output layer a chunk at a time. At a 49k vocabulary that is what a micro-batch
is made of — 64 × 128 response tokens' float32 logits are 1.5 GiB, their gradient as much again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 2**26  # floats per [rows, V] temporary: 256 MiB in float32, ~450 rows of a 150k vocabulary
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # config keys: logits ≠ head(hidden)


def token_logprobs(
    logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """log p(tokens[b, t]) under softmax(logits[b, t] / temperature); ``[B, T, V], [B, T] -> [B, T]``.

    ``logits`` must already be aligned with ``tokens``: for a causal LM that is
    ``token_logprobs(out.logits[:, :-1], input_ids[:, 1:])``. Computed in float32 whatever
    the logits' dtype (bf16 log-probs are too coarse for ratios and KL terms), ``chunk_size``
    positions at a time (default: as many as fit :data:`CHUNK_ELEMENTS`); equal to the full
    ``log_softmax`` within 1e-6. ``temperature`` must match the sampler's so ratios start at 1.
    """
    return token_logprobs_and_entropies(logits, tokens, temperature=temperature, chunk_size=chunk_size)[0]


def token_entropies(logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Entropy H = −Σ_v p_v log p_v of softmax(logits / temperature) per position, ``[B, T, V] -> [B, T]``.

    Chunked like :func:`token_logprobs`; differentiable, for the entropy bonus (docs/algorithms.md §4.10).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    _, entropies = chunked_logprobs(flat, None, nn.Identity(), flat.shape[-1], temperature, chunk_size, entropy=True)
    return entropies.view(logits.shape[:-1])


def token_logprobs_and_entropies(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`token_logprobs` and, with ``with_entropy``, :func:`token_entropies` from one pass over
    the logits. ``[B, T, V], [B, T] -> ([B, T], [B, T] or None)``; ``support [B, T, K]``: see
    :func:`chunked_logprobs`."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    flat = logits.reshape(-1, logits.shape[-1])
    logprobs, entropies = chunked_logprobs(
        flat, tokens.reshape(-1), nn.Identity(), flat.shape[-1], temperature, chunk_size, with_entropy,
        support=_flat_support(support),
    )  # fmt: skip
    return logprobs.view(tokens.shape), None if entropies is None else entropies.view(tokens.shape)


def response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int | None = None,
    *,
    response_mask: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    lm_head_chunks: bool = False,
    chunk_size: int | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens of ``prompt ‖ response`` sequences.

    ``input_ids, attention_mask [B, P + T]`` hold left-padded prompts of width P followed by
    right-padded responses; positions follow the attention mask, as in the rollout engines.
    Give P as ``response_start``, or a ``response_mask [B, T]`` (1 on tokens the policy
    produced; 0 on padding and tool/environment tokens), which also zeroes the masked outputs.
    Returns ``[B, T]`` float32 tensors (entropies None unless ``with_entropy``).

    Only the response positions' logits are computed (``logits_to_keep``). With
    ``lm_head_chunks`` the final hidden states go through the output layer ``chunk_size``
    positions at a time, so ``[B, T, V]`` logits never exist at once (tied embeddings
    included); this needs a model whose logits are exactly ``lm_head(hidden)``.
    ``support [B, T, K]``: each token's kept set, renormalised over (:func:`chunked_logprobs`).
    """
    start = _response_start(input_ids, response_start, response_mask)
    tokens = input_ids[:, start:]
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions, "use_cache": False}
    if lm_head_chunks:
        head = _plain_lm_head(model)
        hidden = model.get_decoder()(**inputs).last_hidden_state[:, start - 1 : -1]  # t predicts t + 1
        flat = hidden.reshape(-1, hidden.shape[-1])
        logprobs, entropies = scored_logprobs(
            flat, tokens.reshape(-1), head, head.weight.shape[0], temperature, chunk_size, with_entropy,
            support=_flat_support(support), scored=None if response_mask is None else response_mask.reshape(-1),
        )  # fmt: skip
        logprobs = logprobs.view(tokens.shape)
        entropies = None if entropies is None else entropies.view(tokens.shape)
    else:
        logits = model(**inputs, logits_to_keep=tokens.shape[1] + 1).logits[:, :-1]  # t predicts t + 1
        logprobs, entropies = token_logprobs_and_entropies(
            logits, tokens, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, support=support
        )
    if response_mask is not None:
        logprobs = logprobs * response_mask
        entropies = None if entropies is None else entropies * response_mask
    return logprobs, entropies


def _response_start(input_ids: Tensor, response_start: int | None, response_mask: Tensor | None) -> int:
    """P from ``response_start`` or from the response mask's width; they must agree if both given."""
    length = input_ids.shape[1]
    if response_mask is not None:
        if response_mask.shape[0] != input_ids.shape[0] or response_mask.shape[1] >= length:
            raise ValueError(
                f"response_mask {tuple(response_mask.shape)} must be [B, T] over the response positions "
                f"of input_ids {tuple(input_ids.shape)}"
            )
        from_mask = length - response_mask.shape[1]
        if response_start is not None and response_start != from_mask:
            raise ValueError(f"response_start={response_start} but the response mask starts at {from_mask}")
        response_start = from_mask
    if response_start is None:
        raise ValueError("give response_start (the prompt width P) or a response_mask [B, T]")
    if not 0 < response_start < length:
        raise ValueError(f"response_start={response_start} must lie inside the sequence (1..{length - 1})")
    return response_start


def _plain_lm_head(model: nn.Module) -> nn.Module:
    """The output layer, if the model's logits are exactly ``head(hidden)``; otherwise an error."""
    config = model.config
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"lm_head_chunks: {type(model).__name__} transforms its logits ({name}); use the default")
    head = model.get_output_embeddings()
    if head is None or not hasattr(model, "get_decoder"):
        raise ValueError(f"lm_head_chunks: {type(model).__name__} exposes no decoder/output layer; use the default")
    return head


def output_layer(model: nn.Module) -> nn.Module | None:
    """The output layer to run chunk by chunk over the decoder's hidden states, or None where the
    model's own forward must make the logits: logits that are more than ``head(hidden)``, or a
    model sharded with FSDP2 (running its decoder alone would skip the whole model's unsharding
    of the embeddings and head, which stay sharded when they are tied)."""
    from posttrain.distributed import is_sharded

    try:
        head = _plain_lm_head(model)
    except ValueError:
        return None
    return None if is_sharded(model) else head


def chunked_logprobs(
    inputs: Tensor,
    tokens: Tensor | None,
    to_logits: nn.Module,
    vocab_size: int,
    temperature: float,
    chunk_size: int | None,
    entropy: bool,
    *,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per chunk of rows of ``inputs [N, D]``: logits = to_logits(rows) → (log-probs of ``tokens [N]``,
    entropies), each ``[N]`` float32. Checkpointed under autograd, so backward recomputes each
    chunk instead of keeping every chunk's ``[rows, V]`` temporaries alive.

    ``support [N, K]`` (ids, −1 padded; a row of −1 is the whole vocabulary): the log-prob is
    renormalised over each row's kept set, log π(a) − log Σ_{b∈K} π(b) — the truncated
    distribution the sampler drew from (DeepSeek-V3.2 §3.1, "keep sampling mask"), so that an
    on-policy ratio against the engine's behaviour log-prob starts at 1. Entropies stay those of
    the whole distribution."""
    rows = chunk_size or max(1, CHUNK_ELEMENTS // vocab_size)
    step = partial(_chunk_stats, to_logits=to_logits, temperature=temperature, entropy=entropy)
    logprobs, entropies = [], []
    needs_grad = torch.is_grad_enabled() and (
        inputs.requires_grad or any(p.requires_grad for p in to_logits.parameters())
    )
    for start in range(0, inputs.shape[0], rows):
        piece = inputs[start : start + rows]
        piece_tokens = None if tokens is None else tokens[start : start + rows]
        piece_support = None if support is None else support[start : start + rows]
        args = (piece, piece_tokens, piece_support)
        out = checkpoint(step, *args, use_reentrant=False) if needs_grad else step(*args)
        logprobs.append(out[0])
        entropies.append(out[1])
    if not logprobs:  # no positions at all
        empty = inputs.new_zeros(0, dtype=torch.float32)
        return empty, empty if entropy else None
    return torch.cat(logprobs), torch.cat(entropies) if entropy else None


def scored_logprobs(
    inputs: Tensor,
    tokens: Tensor,
    to_logits: nn.Module,
    vocab_size: int,
    temperature: float,
    chunk_size: int | None,
    entropy: bool,
    *,
    support: Tensor | None = None,
    scored: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`chunked_logprobs` at the positions ``scored [N]`` marks (nonzero; None: all), 0
    elsewhere: the output layer runs only where a token is scored — not on padding, nor on an
    environment's tokens, which are most of a tool episode's response positions."""
    rules = (to_logits, vocab_size, temperature, chunk_size, entropy)
    if scored is None:
        return chunked_logprobs(inputs, tokens, *rules, support=support)
    index = scored.nonzero().flatten()
    picked = None if support is None else support[index]
    logprobs, entropies = chunked_logprobs(inputs[index], tokens[index], *rules, support=picked)
    spread = inputs.new_zeros(inputs.shape[0], dtype=logprobs.dtype)
    return spread.index_copy(0, index, logprobs), None if entropies is None else spread.index_copy(0, index, entropies)


def _flat_support(support: Tensor | None) -> Tensor | None:
    """``[B, T, K] → [B·T, K]`` (None stays None)."""
    return None if support is None else support.reshape(-1, support.shape[-1])


def _chunk_stats(
    rows: Tensor,
    tokens: Tensor | None,
    support: Tensor | None,
    *,
    to_logits: Callable[[Tensor], Tensor],
    temperature: float,
    entropy: bool,
) -> tuple[Tensor, Tensor]:
    """``[n, D] → ([n], [n])``; the exact arithmetic of the naive formulas, row by row."""
    z = to_logits(rows).float()  # the float32 upcast happens here, one chunk at a time
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    empty = z.new_zeros(0)
    picked = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) if tokens is not None else empty
    if support is not None and tokens is not None:
        ids = support.to(device=logp.device, dtype=torch.long)
        kept_mass = logp.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, float("-inf")).logsumexp(-1)
        picked = picked - torch.where(ids[:, 0] < 0, 0.0, kept_mass)  # a row of −1: the whole vocabulary
    # −Σ softmax·log_softmax rather than logsumexp(z) − Σ p·z: the latter subtracts two numbers
    # of size |z| and loses ~1e-5 to cancellation on a 32k vocabulary
    entropies = -(torch.softmax(z, dim=-1) * logp).sum(-1) if entropy else empty
    return picked, entropies


def _encode_prompts(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, prompt_index: Tensor, head: nn.Module | None
) -> tuple[Any, Tensor]:
    """The U prompts' KV cache indexed out to the B rows that continue them, and each row's
    output at its prompt's last position (which predicts response token 0): its logits, or with
    ``head`` (:func:`output_layer`) its final hidden state."""
    from transformers import DynamicCache

    from posttrain.models.cache import cache_argument, returned_cache, select_rows

    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    runner, keep = (model, {"logits_to_keep": 1}) if head is None else (model.get_decoder(), {})
    prompt_out = runner(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        use_cache=True,
        **keep,
        **cache_argument(runner, DynamicCache(config=model.config)),
    )
    cache = returned_cache(prompt_out)
    select_rows(cache, prompt_index)
    last = prompt_out.logits if head is None else prompt_out.last_hidden_state
    return cache, last[:, -1].index_select(0, prompt_index)  # index_select: see select_rows


def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    prompt_index: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    response_attention: Tensor | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`response_logprobs` for responses that share prompts, encoding each prompt once.

    ``prompt_ids, prompt_mask [U, P]`` hold U distinct left-padded prompts; response row b
    continues prompt ``prompt_index[b]`` (``response_ids, response_mask [B, T]``). A group of
    G samples per prompt is the usual case: the prompt's keys and values are computed once
    and indexed out to its G rows (differentiably, so gradients still reach the prompt
    positions), then the responses run against them. With prompts three times longer than
    responses and G = 8 this does about a third of the full forward's work; values equal the
    full forward's up to float rounding (tests/models/test_logprobs.py).

    ``response_attention [B, T]`` marks the response tokens attended to when that is more than
    ``response_mask`` (a multi-turn episode's environment tokens: context, never targets).

    Needs a model that accepts a transformers ``DynamicCache`` (``cache``, or ``past_key_values``
    before transformers 5.2x).
    """
    if response_ids.shape[1] == 0:
        empty = response_ids.new_zeros(response_ids.shape, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    head = output_layer(model)
    cache, first = _encode_prompts(model, prompt_ids, prompt_mask, prompt_index, head)
    width = response_ids.shape[1]
    lengths = prompt_mask.long().sum(-1)[prompt_index]
    response_positions = lengths[:, None] + torch.arange(width, device=response_ids.device)
    attended = response_mask if response_attention is None else response_attention
    attention = torch.cat([prompt_mask[prompt_index].long(), attended.long()], dim=1)
    outputs = _response_outputs(model, head, cache, first, response_ids, attention, response_positions)
    to_logits = nn.Identity() if head is None else head
    vocab = outputs.shape[-1] if head is None else head.weight.shape[0]
    flat = outputs.reshape(-1, outputs.shape[-1])
    logprobs, entropies = scored_logprobs(
        flat, response_ids.reshape(-1), to_logits, vocab, temperature, chunk_size, with_entropy,
        support=_flat_support(support), scored=response_mask.reshape(-1),
    )  # fmt: skip
    logprobs = logprobs.view(response_ids.shape) * response_mask
    return logprobs, None if entropies is None else entropies.view(response_ids.shape) * response_mask


def _response_outputs(
    model: nn.Module, head: nn.Module | None, cache: Any, first: Tensor, response_ids: Tensor, attention: Tensor,
    positions: Tensor,
) -> Tensor:  # fmt: skip
    """The responses run against their prompts' ``cache``: ``[B, T, V]`` logits, or with a plain
    ``head`` ``[B, T, D]`` hidden states, position t predicting response token t (``first``: the
    prompts' last output, which predicts token 0)."""
    from posttrain.models.cache import cache_argument

    outputs = first[:, None]
    if response_ids.shape[1] > 1:
        runner = model if head is None else model.get_decoder()
        out = runner(
            input_ids=response_ids[:, :-1],
            attention_mask=attention[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            **cache_argument(runner, cache),
        )
        rest = out.logits if head is None else out.last_hidden_state
        outputs = torch.cat([outputs, rest], dim=1)
    return outputs
