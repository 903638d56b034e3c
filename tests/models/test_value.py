"""The critic: shapes, initialisation from the policy (object or folder), save/load with plain transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForTokenClassification

from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.models.value import load_value_model, response_values, value_model_from_policy, values

IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 0, 0]])
MASK = (IDS != 0).long()


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer()
    policy = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    policy.save_pretrained(folder)
    return folder, policy


def test_critic_copies_the_policy_body_and_starts_at_zero(policy_folder):
    _, policy = policy_folder
    critic = value_model_from_policy(policy)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], tensor), name
    critic.model.embed_tokens.weight.data.add_(1.0)  # a copy, not shared
    assert not torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert values(critic, IDS, MASK).shape == (2, 7) and not values(critic, IDS, MASK).any()
    assert critic.dropout.p == 0.0


def test_values_shapes_and_response_alignment(policy_folder):
    _, policy = policy_folder
    critic = value_model_from_policy(policy, head_std=1.0).eval()
    with torch.no_grad():
        every = values(critic, IDS, MASK)
        response = response_values(critic, IDS, MASK, response_start=4)
    assert every.dtype == torch.float32 and response.shape == (2, 3)
    torch.testing.assert_close(response, every[:, 3:6])  # V(s_t) read where token t is predicted
    with torch.no_grad():  # left padding does not change a row's values
        alone = values(critic, IDS[:1, 2:], MASK[:1, 2:])
    torch.testing.assert_close(every[:1, 2:], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="inside the sequence"):
        response_values(critic, IDS, MASK, response_start=7)


def test_save_and_load_round_trip_with_plain_transformers(policy_folder, tmp_path):
    _, policy = policy_folder
    critic = value_model_from_policy(policy, head_std=1.0).eval()
    critic.save_pretrained(tmp_path)
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    ours = load_value_model(tmp_path).eval()
    with torch.no_grad():
        expected = values(critic, IDS, MASK)
        torch.testing.assert_close(values(plain, IDS, MASK), expected)
        torch.testing.assert_close(values(ours, IDS, MASK), expected)
    assert plain.dropout.p == 0.0  # the saved config keeps the head free of dropout


def test_critic_from_a_policy_folder(policy_folder):
    folder, policy = policy_folder
    critic = load_value_model(folder, dtype="bfloat16")
    assert critic.dtype == torch.bfloat16 and critic.dropout.p == 0.0
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight.bfloat16())
    assert not critic.score.weight.any()  # fresh head: zeros, as from the policy object
    assert not values(critic, IDS, MASK).any()
