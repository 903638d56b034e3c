"""The light critic (models/adapter_critic.py): the LoRA policy's shared base with the policy's
adapters off and the critic's own on, and a scalar head — computed as the plain critic whose
projections are W + (α/r)·B_c·A_c would compute it; only its adapters and head train; the policy's
forward is untouched by it, also with gradient checkpointing recomputing layers in backward."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models.adapter_critic import AdapterCritic, critic_pass
from posttrain.models.lora import apply_lora
from posttrain.models.section import LoraSection
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.models.value import critic_for, response_values, value_model_from_policy, values

IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def lora_policy(seed: int = 0):
    torch.manual_seed(seed)
    model = build_tiny_causal_lm(len(build_char_tokenizer()), layers=2, hidden=32, heads=2)
    policy = apply_lora(model, r=4, alpha=8)
    with torch.no_grad():  # adapters that change the policy's output (B starts at 0)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return policy


def trained_critic(policy) -> AdapterCritic:
    critic = AdapterCritic(policy, r=4, alpha=8)
    with torch.no_grad():
        for param in critic.lora_B:
            param.normal_(std=0.2)
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.3)
    return critic


def test_values_are_the_plain_critic_with_the_critics_adapters_folded_into_the_base():
    policy = lora_policy()
    critic = trained_critic(policy)
    plain = value_model_from_policy(policy)  # the base body (policy adapters left out), a zero head
    folded = {}
    layers = dict(plain.named_modules())
    names = [name for name, m in policy.get_base_model().named_modules() if type(m).__name__ == "Linear" and
             hasattr(m, "lora_A")]  # fmt: skip
    assert len(names) == len(critic.targets) == 2 * 7
    with torch.no_grad():
        for index, name in enumerate(names):
            layer = layers[name]  # same module names in the token classifier
            folded[name] = layer.weight + critic.scaling * critic.lora_B[index] @ critic.lora_A[index]
            layer.weight.copy_(folded[name])
        plain.score.weight.copy_(critic.score.weight)
        plain.score.bias.copy_(critic.score.bias)
        expected, got = values(plain.eval(), IDS, MASK), values(critic, IDS, MASK)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert got.abs().max() > 0.1  # not trivially zero
    start = response_values(AdapterCritic(policy, r=4, alpha=8), IDS, MASK, 3)
    assert not start.any()  # a fresh critic's values are 0, as the full critic's


def test_only_the_critics_adapters_and_head_train_and_the_policy_is_untouched():
    policy = lora_policy()
    before = policy(input_ids=IDS, attention_mask=MASK).logits.detach()
    critic = trained_critic(policy)
    names = {name for name, _ in critic.named_parameters()}
    assert all(name.startswith(("lora_A.", "lora_B.", "score.")) for name in names)
    assert sum(p.numel() for p in critic.parameters()) == 2 * (4 * 4 * (32 + 32) + 3 * 4 * (32 + 128)) + 33
    values(critic, IDS, MASK).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.parameters())
    assert all(p.grad is None for p in policy.parameters())  # the policy's adapters were off, its base frozen
    after = policy(input_ids=IDS, attention_mask=MASK).logits.detach()
    torch.testing.assert_close(after, before, atol=0, rtol=0)  # no hook left behind, adapters back on
    assert not critic.state_dict().keys() - names  # the checkpoint holds its own tensors alone


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_are_the_same_when_layers_are_recomputed_in_backward(checkpointing):
    """Gradient checkpointing recomputes each layer in backward: inside ``critic_pass`` the
    recomputation sees the critic's adapters too, so the gradients equal the plain pass's."""
    policy = lora_policy()
    critic = trained_critic(policy)
    reference = [g.clone() for g in _critic_grads(critic)]
    other = lora_policy()
    other.load_state_dict(policy.state_dict())
    twin = trained_critic(other)
    twin.load_state_dict(critic.state_dict())
    if checkpointing:
        other.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
    other.train()
    for got, expected in zip(_critic_grads(twin), reference, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def _critic_grads(critic: AdapterCritic) -> list[torch.Tensor]:
    critic.zero_grad(set_to_none=True)
    with critic_pass(critic):
        (values(critic, IDS, MASK) ** 2).sum().backward()
    return [p.grad for p in critic.parameters()]


def test_critic_for_picks_shared_adapters_own_adapters_or_a_full_critic():
    lora = LoraSection(r=4, alpha=8)
    policy = lora_policy()
    assert isinstance(critic_for(policy, lora=lora), AdapterCritic)
    full = critic_for(policy)  # a LoRA policy, a critic trained in full: the base body, copied
    assert all(p.requires_grad for p in full.parameters()) and not hasattr(full, "get_base_model")
    torch.manual_seed(0)
    plain_policy = build_tiny_causal_lm(len(build_char_tokenizer()), layers=2, hidden=32, heads=2)
    own = critic_for(copy.deepcopy(plain_policy), lora=lora)  # a full policy: a frozen copy under adapters
    trained = {name for name, p in own.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or "score" in name for name in trained)
    with torch.no_grad():  # it starts as the full critic does: values 0
        assert not values(own, IDS, MASK).any()
