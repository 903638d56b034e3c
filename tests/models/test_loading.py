"""Loading local folders, the critic, the reward scorer and LoRA's free reference policy."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from posttrain.models.logprobs import token_logprobs
from posttrain.models.lora import apply_lora, merge_adapters, reference_policy
from posttrain.models.reward import load_reward_model, reward_model_from_policy
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.models.value import load_value_model, value_model_from_policy, values


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def test_load_by_path_like_a_user_checkpoint(saved):
    folder, model, _ = saved
    loaded = load_causal_lm(folder, gradient_checkpointing=True)
    assert loaded.is_gradient_checkpointing
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded.eval()(ids).logits, model.eval()(ids).logits)
    assert load_causal_lm(folder, dtype="bfloat16").dtype == torch.bfloat16
    assert load_tokenizer(folder).pad_token == "<pad>"


def test_bad_paths_say_what_is_wrong(tmp_path, saved):
    with pytest.raises(ModelLoadError, match="local folders only"):
        load_causal_lm("Qwen/Qwen2-0.5B")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ModelLoadError, match=r"no config\.json \(found: weights\.bin\)"):
        load_causal_lm(tmp_path)
    with pytest.raises(ModelLoadError, match="is a file"):
        load_causal_lm(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_causal_lm(saved[0], dtype="fp8")


def test_critic_starts_from_the_policy_and_round_trips(tmp_path, saved):
    _, policy, _ = saved
    critic = value_model_from_policy(policy)
    ids, mask = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    assert values(critic, ids, mask).tolist() == [[0.0, 0.0, 0.0, 0.0]]  # zero head: V = 0 at the start
    torch.testing.assert_close(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    torch.nn.init.normal_(critic.score.weight)
    critic.save_pretrained(tmp_path)
    again = load_value_model(tmp_path)
    torch.testing.assert_close(values(again, ids, mask), values(critic, ids, mask))


def test_reward_scores_are_read_at_the_last_real_token(saved):
    _, policy, tokenizer = saved
    scorer = reward_model_from_policy(policy, tokenizer.pad_token_id).eval()
    torch.nn.init.normal_(scorer.score.weight)
    rows = [[5, 6, 7, 8, 9], [10, 11]]
    batch = torch.tensor([rows[0], rows[1] + [tokenizer.pad_token_id] * 3])
    with torch.no_grad():
        together = scorer(input_ids=batch, attention_mask=(batch != tokenizer.pad_token_id).long()).logits[:, 0]
        alone = [scorer(input_ids=torch.tensor([r])).logits[0, 0] for r in rows]
    torch.testing.assert_close(together, torch.stack(alone), atol=1e-5, rtol=0)  # scores are O(10)


def test_saved_reward_model_needs_a_pad_id(tmp_path, saved):
    _, policy, tokenizer = saved
    scorer = reward_model_from_policy(policy, tokenizer.pad_token_id)
    scorer.save_pretrained(tmp_path / "rm")
    assert isinstance(load_reward_model(tmp_path / "rm"), torch.nn.Module)
    scorer.config.pad_token_id = None
    scorer.save_pretrained(tmp_path / "rm_nopad")
    with pytest.raises(ValueError, match="no pad_token_id"):
        load_reward_model(tmp_path / "rm_nopad")


def test_lora_reference_is_the_base_model_even_after_training(tmp_path, saved):
    folder, _, _ = saved
    base = load_causal_lm(folder).eval()
    policy = apply_lora(load_causal_lm(folder), r=4, alpha=8)
    with torch.no_grad():  # peft initialises B = 0; move the adapters so they matter
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for _ in range(3):
        policy(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.eval()

    def logprobs(model):
        with torch.no_grad():
            return token_logprobs(model(ids).logits[:, :-1], ids[:, 1:])

    with reference_policy(policy):
        reference = logprobs(policy)
    torch.testing.assert_close(reference, logprobs(base), atol=1e-6, rtol=0)
    assert (logprobs(policy) - reference).abs().max() > 1e-3  # the adapters did change the policy
    merged = merge_adapters(policy)
    merged.save_pretrained(tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logprobs(plain), logprobs(merged), atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="frozen copy"), reference_policy(base):
        pass
