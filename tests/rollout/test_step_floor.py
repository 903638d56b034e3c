"""benchmarks/step_floor.py counts a decoding step's work as the step does it: the FLOPs it
credits a step with are those PyTorch's FLOP counter sees in a real one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.rollout.native import NativeDecoder

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_floor.py"


def load_step_floor():
    spec = importlib.util.spec_from_file_location("step_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floor_counts_the_flops_of_a_real_decoding_step():
    step_floor = load_step_floor()
    # grouped-query attention (4 heads over 2) and an intermediate size apart from the hidden one
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    decoder = NativeDecoder(model)
    rows, width = 6, 9
    ids = torch.randint(3, 97, (rows, width))
    decoder.prefill(ids, torch.ones_like(ids), 4)
    with FlopCounterMode(display=False) as counter:
        decoder.decode(torch.randint(3, 97, (rows,)))
    flops, cache = step_floor.step_work(decoder, rows, span=width + 1)  # the new token attends to itself too
    assert flops == counter.get_total_flops()
    assert cache == 2 * 3 * rows * 2 * (width + 1) * 16 * 4  # keys and values: layers, rows, kv heads, span, D
