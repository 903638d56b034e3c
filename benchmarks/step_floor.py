"""How fast a decoding step of the native engine could be on this machine: its arithmetic at the
machine's measured matrix-product rate plus its KV-cache reads at the measured read rate.

A floor, not a forecast: it assumes every product runs at the rate of a large one and attention
reads the cache once at the speed of a plain sum. The measured step over this floor says how much
of the step is per-op overhead and kernels below that rate (at 64 rows a 128-wide model's products
run well under a large product's rate, and attention's batched one-query products under the read
rate), which is what a faster step would have to remove.
"""

from __future__ import annotations

import statistics
import time

import torch

from posttrain.rollout.native import NativeDecoder


def _median_seconds(run, repeats: int = 15) -> float:
    """Median, not best: on a shared VM a product's rate spans 175-307 GFLOP/s from call to call
    (turbo and neighbours), and the best would set a floor no sustained run meets."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def product_rate(size: int = 1024) -> float:
    """FLOP/s of one ``size``³ float32 product on this CPU (its threads as set)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _median_seconds(lambda: torch.mm(a, b))


def read_rate(nbytes: int) -> float:
    """Bytes/s of summing a float32 tensor of ``nbytes`` over and over: from cache where a step's
    KV cache of that size fits in it (the tiny model's 13 MB), from memory where it does not
    (SmolLM2's 224 MB) — the fastest a step's attention could read its cache."""
    data = torch.randn(max(nbytes // 4, 1))
    return data.numel() * 4 / _median_seconds(data.sum)


def step_work(decoder: NativeDecoder, rows: int, span: int) -> tuple[float, float]:
    """One decoding step's (FLOPs, KV-cache bytes read) for ``rows`` rows attending to ``span``
    positions: every projection and the output layer, q·k and p·v for each head."""
    config = decoder.causal_lm.config  # not the decoder's fused weights: a finished batch releases them
    hidden, heads, kv, d = decoder.hidden, decoder.heads, decoder.kv_heads, decoder.head_dim
    layers = config.num_hidden_layers
    per_layer = hidden * (heads + 2 * kv) * d + heads * d * hidden + 3 * hidden * config.intermediate_size
    attention = 2 * heads * d * span  # q·k and p·v multiply-adds
    flops = 2 * rows * (layers * (per_layer + attention) + config.vocab_size * hidden)
    cache = 2 * layers * rows * kv * span * d * decoder.embed.element_size()
    return flops, cache


def decode_floor(decoder: NativeDecoder, rows: int, span: int) -> dict[str, float]:
    """The step's floor in ms, its two parts, and the rates measured here."""
    flops, cache = step_work(decoder, rows, span)
    peak, read = product_rate(), read_rate(cache)
    products_ms, reads_ms = flops / peak * 1e3, cache / read * 1e3
    return {
        "floor_ms": round(products_ms + reads_ms, 3),
        "products_ms": round(products_ms, 3),
        "cache_reads_ms": round(reads_ms, 3),
        "step_mflop": round(flops / 1e6, 1),
        "cache_mb": round(cache / 1e6, 2),
        "product_gflops": round(peak / 1e9, 1),
        "read_gb_per_s": round(read / 1e9, 1),
    }
