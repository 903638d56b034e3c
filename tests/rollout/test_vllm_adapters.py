"""Adapter-only weight sync to vLLM (rollout/vllm_adapters.py): a LoRA policy's engine starts on the
frozen base and takes each version's adapter as a LoRA request; its log-probs equal the trainer's
forward of the adapted model before and after a sync; a version vLLM does not list as loaded
stops sampling; a policy whose adapter vLLM cannot load is sent folded, saying why.

Runs in .venv-vllm (make test-vllm); skipped without vLLM."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment (bash scripts/install_vllm_cpu.sh builds .venv-vllm, "
        "where these tests run)",
        allow_module_level=True,
    )

from posttrain.models.lora import apply_lora
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams
from posttrain.rollout.vllm_adapters import adapter_sync_reason
from posttrain.rollout.vllm_engine import VLLMOptions, WeightSyncError
from tests.rollout.conftest import encode, full_forward_logprobs

TOLERANCE = 1e-4  # as for the full sync (test_vllm_engine.py): float32 on both sides
OPTIONS = VLLMOptions(max_model_len=128)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def lora_policy(tokenizer, r: int = 4):
    """A tiny LoRA policy (head dim 32, as vLLM's CPU attention needs) whose adapters matter."""
    base = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=64, heads=2, seed=0, tokenizer=tokenizer)
    policy = apply_lora(base, r=r, alpha=2 * r).eval()
    perturb(policy, seed=11)
    return policy


def perturb(policy, seed: int) -> None:
    """An update: every adapter matrix moved (B starts at 0)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return lora_policy(tokenizer)


@pytest.fixture(scope="module")
def engine(policy, tokenizer):
    engine = build_engine(policy, tokenizer, "vllm", vllm_options=OPTIONS)
    yield engine
    engine.close()


def sampled(engine, tokenizer, seed: int):
    return engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=16, seed=seed))


def test_the_engine_takes_the_adapter_alone_and_samples_the_adapted_model(engine, policy, tokenizer):
    assert engine.adapters is not None and engine.llm.llm_engine.list_loras() == {1}  # version 0's id
    out = sampled(engine, tokenizer, seed=1)
    assert (out.logprobs - full_forward_logprobs(policy, out)).abs().max() < TOLERANCE
    with policy.disable_adapter():  # the base alone computes something else: the adapter was applied
        assert (out.logprobs - full_forward_logprobs(policy, out)).abs().max() > 10 * TOLERANCE


def test_after_an_update_only_the_new_version_is_loaded_and_sampled(engine, policy, tokenizer):
    first = Path(engine.adapters.request.lora_path)
    perturb(policy, seed=12)
    engine.update_weights(1)
    assert engine.policy_version == 1 and engine.last_sync_s > 0
    assert engine.llm.llm_engine.list_loras() == {2} and not first.exists()  # one slot: the live version
    out = sampled(engine, tokenizer, seed=2)
    assert out.policy_version.eq(1).all()
    assert (out.logprobs - full_forward_logprobs(policy, out)).abs().max() < TOLERANCE
    exported = Path(engine.adapters.request.lora_path)
    assert {p.name for p in exported.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert sum(p.stat().st_size for p in exported.iterdir()) < 0.25 * engine_folder_bytes(engine)


def engine_folder_bytes(engine) -> int:
    return sum(p.stat().st_size for p in Path(engine._folder.name).glob("*.safetensors"))


def test_a_version_vllm_does_not_list_as_loaded_stops_sampling(engine, policy, tokenizer, monkeypatch):
    """An add_lora that silently did nothing: the receipt (list_loras) lacks the new id."""
    monkeypatch.setattr(engine.llm.llm_engine, "add_lora", lambda request: True)
    perturb(policy, seed=13)
    with pytest.raises(WeightSyncError, match=r"policy version 2 failed.*adapters \[2\] lack version 2's"):
        engine.update_weights(2)
    with pytest.raises(WeightSyncError, match="refusing to sample"):
        sampled(engine, tokenizer, seed=3)
    assert engine.policy_version == 1
    monkeypatch.undo()
    engine.update_weights(3)
    out = sampled(engine, tokenizer, seed=3)
    assert (out.logprobs - full_forward_logprobs(policy, out)).abs().max() < TOLERANCE


def test_what_vllm_cannot_load_as_an_adapter_is_sent_folded(tokenizer):
    policy = lora_policy(tokenizer)
    assert adapter_sync_reason(policy) is None
    assert adapter_sync_reason(policy.get_base_model()) == "the policy has no LoRA adapters"
    two = copy.deepcopy(policy)
    two.add_adapter("second", copy.deepcopy(policy.peft_config["default"]))
    assert adapter_sync_reason(two) == "2 adapters (vLLM serves one per request)"
    full = build_engine(policy, tokenizer, "vllm", vllm_options=VLLMOptions(max_model_len=128, weight_sync="full"))
    try:
        assert full.adapters is None  # the folded weights, as a plain model
        out = sampled(full, tokenizer, seed=4)
        assert (out.logprobs - full_forward_logprobs(policy, out)).abs().max() < TOLERANCE
    finally:
        full.close()
