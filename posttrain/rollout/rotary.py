"""Rotary position embeddings as the native decoder applies them: one multiply per pair.

The decoder stores each head's q and k rows pair-interleaved (``projections.interleave_pairs``):
the pairs (i, i + D/2) that a Llama rotary embedding rotates together sit side by side, so the
rotation of position p is the complex product (x₀ + i·x₁)(cos pθ + i·sin pθ) (RoFormer, Su et
al. 2021; the split halves of the transformers Llama code, permuted).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_pairs(qk: Tensor, rotations: Tensor) -> Tensor:
    """Rotate pair-interleaved ``qk [..., heads, D]`` by ``rotations``: complex ``[..., 1, D/2]``,
    or the same as real (cos, sin) pairs ``[..., 1, D/2, 2]`` (``torch.view_as_real``), which a
    compiled step takes: Inductor generates no code for complex numbers and would leave the
    multiply to eager PyTorch (static_decode.py). Computed in float32 (there is no complex type
    below it), returned in ``qk``'s dtype."""
    if qk.dtype != torch.float32:
        return rotate_pairs(qk.float(), rotations).to(qk.dtype)
    if qk.stride(-1) != 1:  # a weight-major projection's output (products.linear)
        qk = qk.contiguous()
    if not rotations.is_complex():  # (x0 + i·x1)(cos + i·sin), written out
        x0, x1 = qk.unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = rotations.unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    pairs = torch.view_as_complex(qk.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotations).flatten(-2)
