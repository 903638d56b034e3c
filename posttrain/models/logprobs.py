"""Log-probabilities (and entropies) of the tokens a sequence actually contains.

Every loss in posttrain (SFT, the policy losses, KL to a reference) starts from these. With a
real vocabulary (~150k) a full ``[B, T, V]`` float32 log-softmax is the largest tensor of a
training step, so it is computed chunk by chunk of positions, with the float32 upcast done
per chunk too.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 4096  # positions per chunk: [4096, V] floats at a time


def token_logprobs(
    logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """log p(tokens[b, t]) under softmax(logits[b, t] / temperature); ``[B, T, V], [B, T] -> [B, T]``.

    ``logits`` must already be aligned with ``tokens``: for a causal LM that is
    ``token_logprobs(out.logits[:, :-1], input_ids[:, 1:])``. Computed in float32 whatever
    the logits' dtype (bf16 log-probs are too coarse for ratios and KL terms), without
    materialising the whole log-softmax; equal to the naive computation (tested to 1e-6).
    ``temperature`` must match the sampler's so that ratios start at exactly 1.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_tokens = tokens.reshape(-1).long()
    out = torch.empty(flat_tokens.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_tokens.numel(), chunk_size):
        piece = flat_logits[start : start + chunk_size].float()
        if temperature != 1.0:
            piece = piece / temperature
        # log_softmax row by row is exactly the naive result (same kernel, same reduction
        # order); only the chunk's [chunk, V] block exists at a time
        picked = torch.log_softmax(piece, dim=-1).gather(-1, flat_tokens[start : start + chunk_size].unsqueeze(-1))
        out[start : start + chunk_size] = picked.squeeze(-1)
    return out.view(tokens.shape)


def token_entropies(logits: Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, ``[B, T, V] -> [B, T]``, chunked.

    H = logsumexp(z) − Σ softmax(z)·z (ALGORITHMS.md §4.10); differentiable, for the entropy bonus.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()
        if temperature != 1.0:
            z = z / temperature
        pieces.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1))
    if not pieces:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(pieces).view(logits.shape[:-1])


def response_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens of ``prompt ‖ response`` sequences.

    ``input_ids, attention_mask [B, P + T]`` hold left-padded prompts of width ``response_start``
    = P followed by right-padded responses; positions follow the attention mask, as in the
    rollout engines. Returns ``[B, T]`` tensors (entropies None unless asked for).
    """
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    logits = logits[:, response_start - 1 : -1]  # position t predicts token t + 1
    logprobs = token_logprobs(logits, input_ids[:, response_start:], temperature=temperature)
    entropies = token_entropies(logits, temperature=temperature) if with_entropy else None
    return logprobs, entropies
