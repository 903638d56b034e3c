"""How a decoding step multiplies its activations by the weights on a CPU.

A decoding step multiplies a few dozen rows by every weight matrix of the model. At that shape
the BLAS spends a noticeable share of each product rearranging the weight into the blocks its
kernel reads, work it redoes every step although the weights do not change during a batch.
Three ways, all computing ``x @ weightᵀ`` (to float32 rounding):

- **plain** ``F.linear``: for a small model whose weights stay in cache;
- **weight-major** ``(weight @ xᵀ)ᵀ``: the large operand streamed as it is stored, the small one
  repacked (see :func:`linear`);
- **packed**: MKL's own packed copy of each weight (``cblas_sgemm_pack``, through PyTorch's
  ``mkl::_mkl_linear``, the op Inductor uses for frozen CPU linears), made once for a batch's
  row count and reused every step. SmolLM2-135M's projections alone at 64 rows on 2 cores:
  ~207 GFLOP/s against 143–180 weight-major; a whole generation 1.10× (benchmarks/README.md,
  ``generation_speed.py --sides native,native-unpacked``). A pack serves products of
  exactly the row count it was made for (MKL's packed format is chosen for it) and costs a
  pass over the weights, so the decoder packs only where the rows × steps still to decode
  repay it, and drops the packs with the weights they were made from. The packs hold about as
  much memory as the weights, so a model is packed only while that is a small share of the
  machine's (:func:`packs_fit`; the memory plan counts them, plan/plan.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

WEIGHT_MAJOR_FROM = 512  # hidden size from which decoding multiplies weight-major (see linear)
# Rows × steps still to decode from which packing the weights pays. SmolLM2-135M (2 cores):
# packing all its weights takes 0.4–0.6 s; in generation_speed.py's 64 × 128 run it saved 19 ms
# a step (0.3 ms per row and step; 80 ms a step in a profile of the step alone), so it breaks
# even at ~1,300–2,000 row-steps; a 128-token batch of 64 is 8,128.
PACK_FROM_ROW_STEPS = 2048
# The most of this process's share of the machine's memory the packs may take: SmolLM2-135M's
# 0.54 GB and a 0.5B model's 2 GB are packed on a 24 GB machine, a 1.5B model's 6 GB is not
# (its weights, gradients and optimizer state want that memory more than decoding wants speed).
PACKS_SHARE_OF_MEMORY = 1 / 8


def linear(x: Tensor, weight: Tensor, weight_major: bool = False, residual: Tensor | None = None) -> Tensor:
    """``x [N, in] @ weightᵀ`` (``weight [out, in]``), plus ``residual [N, out]`` when given.

    Weight-major computes ``(weight @ xᵀ)ᵀ`` and returns that transposed view: the same dot
    products, but the large operand is streamed as it is stored while the small one is
    repacked by the BLAS, which for a few dozen rows against weights that do not fit in cache
    is ~10–25% faster (SmolLM2-135M's projections, 64 rows, MKL on 2 cores). For a small
    model whose weights stay in cache it only adds transposes.
    """
    if not weight_major:
        return F.linear(x, weight) if residual is None else torch.addmm(residual, x, weight.t())
    out = torch.mm(weight, x.t()).t()
    return out if residual is None else residual + out


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch packs weights for MKL here: float32 on a CPU, with MKL built in
    (x86 wheels; not the aarch64 ones)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


def packs_fit(nbytes: int) -> bool:
    """Whether packs of ``nbytes`` weight bytes are a small enough share of the memory of this
    machine, split between the processes torchrun started on it (False where it is unknown)."""
    if not hasattr(os, "sysconf") or "SC_PHYS_PAGES" not in os.sysconf_names:
        return False
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return nbytes <= total // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * PACKS_SHARE_OF_MEMORY


def packs_pay(device: torch.device, dtype: torch.dtype, hidden: int, nbytes: int) -> bool:
    """Whether the native decoder packs its ``nbytes`` of weights (``hidden`` wide) for its
    decoding steps: where they are streamed from memory (a CPU, from :data:`WEIGHT_MAJOR_FROM`
    wide), MKL can pack them, and the packs fit (the decoder and the memory plan both ask)."""
    if device.type != "cpu" or hidden < WEIGHT_MAJOR_FROM:
        return False
    return can_pack(device, dtype) and packs_fit(nbytes)


class StepProducts:
    """The products of a decoding step: by MKL-packed weights made for one row count where
    there are such packs (:meth:`pack`), else weight-major or plain (:func:`linear`).

    Packs are looked up by the weight tensor itself (its address and shape): whoever rewrites
    or drops the weights calls :meth:`clear` (the decoder does so in ``refresh`` and ``release``)."""

    def __init__(self, weight_major: bool = False, packing: bool = False) -> None:
        self.weight_major = weight_major  # for weights that do not fit in cache (see linear)
        self.packing = packing  # whether the decoder packs (needs can_pack)
        self.rows = 0  # the row count the packs serve; 0: none
        self._packs: dict[tuple[int, tuple[int, ...]], Tensor] = {}

    def clear(self) -> None:
        self.rows, self._packs = 0, {}

    def pack(self, weights: Iterable[Tensor], rows: int) -> None:
        """Pack ``weights`` (each ``[out, in]``, float32, contiguous) for ``rows``-row products."""
        self.clear()
        for weight in weights:
            self._packs[self._key(weight)] = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        self.rows = rows

    def packed_bytes(self) -> int:
        """The float32 bytes of the weights packed now; their packs take about as much resident
        memory (SmolLM2-135M: 540 MB for its 538 MB of weights)."""
        return sum(4 * rows * columns for _, (rows, columns) in self._packs)

    def __call__(self, x: Tensor, weight: Tensor, residual: Tensor | None = None) -> Tensor:
        """``x [N, in] @ weightᵀ (+ residual)``."""
        packed = self._packed(x, weight)
        if packed is None:
            return linear(x, weight, self.weight_major, residual)
        return packed if residual is None else packed.add_(residual)

    def logits(self, x: Tensor, head: Tensor, out: Tensor, scratch: Tensor, chunk: int) -> Tensor:
        """``x [B, H] @ headᵀ`` written into ``out [B, V]``: the output layer, the largest product
        of a step (49k × 576 for SmolLM2). Weight-major (``head @ xᵀ``, ~25% faster there) or
        packed, it runs ``chunk`` vocabulary rows at a time, each slice's product (weight-major:
        in ``scratch``, ≥ chunk·B) copied into ``out`` while still in cache."""
        batch, vocab = x.shape[0], head.shape[0]
        if not self.weight_major and self.rows != batch:
            return torch.mm(x, head.t(), out=out)
        for start in range(0, vocab, chunk):
            end = min(start + chunk, vocab)
            part = self._packed(x, head[start:end])
            if part is None:
                part = torch.mm(head[start:end], x.t(), out=scratch[: (end - start) * batch].view(-1, batch)).t()
            out[:, start:end].copy_(part)
        return out

    def _packed(self, x: Tensor, weight: Tensor) -> Tensor | None:
        if x.shape[0] != self.rows:
            return None
        packed = self._packs.get(self._key(weight))
        return None if packed is None else torch.ops.mkl._mkl_linear(x, packed, weight, None, self.rows)

    @staticmethod
    def _key(weight: Tensor) -> tuple[int, tuple[int, ...]]:
        return weight.data_ptr(), tuple(weight.shape)
