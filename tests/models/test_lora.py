"""LoRA: the adapter-disabled reference is the base model, also after training; merged saves are plain folders."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.logprobs import response_logprobs
from posttrain.models.lora import apply_lora, reference_logprobs, reference_policy, save_merged
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.models.value import value_model_from_policy, values

IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 0]])
MASK = (IDS != 0).long()
PROMPT = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def logprobs_of(model):
    with torch.no_grad():
        return response_logprobs(model, IDS, MASK, PROMPT)[0]


def test_reference_is_the_base_model_even_after_training(tokenizer, tmp_path):
    base = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=32, heads=2, tokenizer=tokenizer).eval()
    policy = apply_lora(copy.deepcopy(base), r=4, alpha=8)
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert not any("lm_head" in name for name in trainable)  # all-linear leaves the output layer alone
    torch.testing.assert_close(logprobs_of(policy), logprobs_of(base), atol=1e-6, rtol=0)  # B = 0 at the start

    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(4):
        logprobs, _ = response_logprobs(policy, IDS, MASK, PROMPT)
        (-logprobs.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.eval()
    assert (logprobs_of(policy) - logprobs_of(base)).abs().max() > 1e-2  # the adapters moved the policy
    reference = reference_logprobs(policy, IDS, MASK, PROMPT)
    torch.testing.assert_close(reference, logprobs_of(base), atol=1e-6, rtol=0)  # ... but not the reference
    torch.testing.assert_close(reference_logprobs(policy, IDS, MASK, PROMPT, lm_head_chunks=True), reference)
    with reference_policy(policy):
        torch.testing.assert_close(logprobs_of(policy), logprobs_of(base), atol=1e-6, rtol=0)
    assert (logprobs_of(policy) - reference).abs().max() > 1e-2  # adapters are back on after the block

    adapted = logprobs_of(policy)
    folder = save_merged(policy, tmp_path / "merged", tokenizer=tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not any("lora" in name for name in plain.state_dict())
    torch.testing.assert_close(logprobs_of(plain), adapted, atol=1e-5, rtol=0)
    assert (folder / "tokenizer.json").is_file()
    # merging a copy left the policy as it was: adapters on, and off again for the reference
    torch.testing.assert_close(logprobs_of(policy), adapted)
    torch.testing.assert_close(reference_logprobs(policy, IDS, MASK, PROMPT), reference)


def test_reference_needs_adapters(tokenizer):
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2)
    with pytest.raises(TypeError, match="frozen copy"), reference_policy(model):
        pass


def test_lora_on_a_critic_trains_the_head_in_full(tokenizer):
    policy = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    critic = apply_lora(value_model_from_policy(policy), r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    trainable = {name for name, p in critic.named_parameters() if p.requires_grad}
    assert any("score" in name and "lora" not in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable if "lora_A" in name} == {"q_proj", "v_proj"}
    assert values(critic, IDS, MASK).shape == IDS.shape
    default = apply_lora(value_model_from_policy(policy), r=4, alpha=8)  # all-linear: the head is not adapted
    assert not any("score" in name and "lora" in name for name, _ in default.named_parameters())
    with pytest.raises(TypeError, match="apply_lora supports"):
        apply_lora(policy.model)
