"""Tiny causal LMs with random weights, for tests, demos and CPU benchmarks.

They use the stock Llama / Qwen2 classes of ``transformers``, so a saved one loads with plain
``AutoModelForCausalLM.from_pretrained(path)`` and anything proven on it (generation, log-probs,
checkpoints) holds for the real models of the same family.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

Arch = Literal["llama", "qwen2"]
_CONFIGS: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny_config(
    vocab_size: int,
    *,
    arch: Arch = "llama",
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 256,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PretrainedConfig:
    """The config of a tiny `arch` decoder; also the starting point of tiny critics and reward models.

    `intermediate` defaults to ``4 * hidden``. With `tokenizer`, its pad/bos/eos ids go into the
    config, so padded batches and ``generate`` use them without being told.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"arch={arch!r} is not one of {sorted(_CONFIGS)}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    return _CONFIGS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        # Untied: the policy's output layer then moves independently of its input embedding,
        # as in most models posttrain fine-tunes at scale.
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )


def build_tiny_causal_lm(
    vocab_size: int,
    *,
    arch: Arch = "llama",
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 256,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """A randomly initialised float32 decoder of the `arch` family (sizes as in :func:`tiny_config`).

    With `tokenizer`, its pad/bos/eos ids go into the model config and the generation config,
    so ``generate`` stops at EOS and pads with ``<pad>`` without being told. The same `seed`
    gives the same weights; the global torch random state is left as it was.
    """
    config = tiny_config(
        vocab_size,
        arch=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        intermediate=intermediate,
        max_positions=max_positions,
        tokenizer=tokenizer,
    )
    # fork_rng keeps the caller's random stream untouched, so building a model in the middle
    # of a seeded run does not shift what comes after it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, value in _special_ids(tokenizer).items():
        setattr(model.generation_config, name, value)
    return model


def _special_ids(tokenizer: PreTrainedTokenizerBase | None) -> dict[str, int | None]:
    if tokenizer is None:
        return {}
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
