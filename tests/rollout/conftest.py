"""Shared pieces of the rollout tests: a tiny model per family, prompts, a reference log-prob."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from posttrain.data.tasks.reverse import make_prompt
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.sampling import behaviour_logprobs
from posttrain.rollout.types import Rollouts, SamplingParams

NAMES = ("sean", "akshita", "joel")


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


def tiny_model(tokenizer, arch: str = "llama", seed: int = 0, kv_heads: int | None = None) -> PreTrainedModel:
    """2 layers × 64 hidden × 4 heads; ``kv_heads`` < 4 gives grouped-query attention.
    Qwen2's q/k/v biases are randomised so that they matter (they start at zero)."""
    if kv_heads is None:
        model = build_tiny_causal_lm(
            len(tokenizer), arch=arch, layers=2, hidden=64, heads=4, seed=seed, tokenizer=tokenizer
        )
    else:
        config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
        config = config_class(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            rope_theta=500.0,  # not the default, so a wrong theta shows
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=True,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.5)
    return model.eval()


def encode(tokenizer, names=NAMES) -> list[list[int]]:
    return [tokenizer(make_prompt(n), add_special_tokens=False)["input_ids"] for n in names]


def full_forward_logprobs(model, rollouts: Rollouts, rules: float | SamplingParams = 1.0) -> torch.Tensor:
    """The behaviour log-prob of each response token from one forward pass over prompt ‖ response,
    ``[B, T]``, 0 off the response mask: log_softmax(logits / T) for a temperature ``rules``, or
    under a ``SamplingParams``' truncation too (``rollout/sampling.py:behaviour_logprobs``)."""
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    start = rollouts.prompt_ids.shape[1]
    rules = rules if isinstance(rules, SamplingParams) else SamplingParams(temperature=rules)
    picked = behaviour_logprobs(logits[:, start - 1 : -1], rollouts.response_ids, rules)
    return picked.masked_fill(rollouts.response_mask == 0, 0.0)
