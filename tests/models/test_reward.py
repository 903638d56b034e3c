"""Sequence scoring: the score is read at the last real token, whatever the padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from posttrain.models.reward import (
    build_reward_model,
    last_token_index,
    load_reward_model,
    reward_model_from_policy,
    sequence_scores,
)
from posttrain.models.tiny import build_tiny_causal_lm, tiny_config
from posttrain.models.tokenizers import build_char_tokenizer

ROWS = [[5, 6, 7, 8, 9, 2], [10, 11, 2], [12, 13, 14, 15]]  # 2 = EOS ends two of them


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def scorer(tokenizer):
    model = build_reward_model(tiny_config(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer), seed=1)
    return model.eval()


def padded(rows, pad_id, side="right"):
    width = max(map(len, rows))
    fill = [[pad_id] * (width - len(r)) for r in rows]
    ids = [r + f if side == "right" else f + r for r, f in zip(rows, fill, strict=True)]
    mask = [
        [1] * len(r) + [0] * len(f) if side == "right" else [0] * len(f) + [1] * len(r)
        for r, f in zip(rows, fill, strict=True)
    ]
    return torch.tensor(ids), torch.tensor(mask)


def one_by_one(model, rows):
    return torch.stack([model(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])


@torch.no_grad()
def test_transformers_reads_the_last_non_pad_token_with_right_padding(scorer, tokenizer):
    ids, mask = padded(ROWS, tokenizer.pad_token_id)
    batch = scorer(input_ids=ids, attention_mask=mask).logits
    assert batch.shape == (3, 1)
    alone = one_by_one(scorer, ROWS)
    torch.testing.assert_close(batch[:, 0], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(sequence_scores(scorer, ids, mask), alone, atol=1e-5, rtol=0)
    assert alone.std() > 1e-3  # rows really score differently, so a wrong index would show


@torch.no_grad()
def test_sequence_scores_hold_for_left_padding_and_pad_equal_to_eos(scorer, tokenizer):
    alone = one_by_one(scorer, ROWS)
    ids, mask = padded(ROWS, tokenizer.pad_token_id, side="left")
    torch.testing.assert_close(sequence_scores(scorer, ids, mask), alone, atol=1e-5, rtol=0)
    eos = tokenizer.eos_token_id
    ids, mask = padded(ROWS, eos)
    scorer.config.pad_token_id = eos
    try:  # transformers skips the EOS a row ends with, reading the token before it
        transformers_scores = scorer(input_ids=ids, attention_mask=mask).logits[:, 0]
    finally:
        scorer.config.pad_token_id = tokenizer.pad_token_id
    assert (transformers_scores - alone).abs()[:2].min() > 1e-4
    torch.testing.assert_close(sequence_scores(scorer, ids, mask), alone, atol=1e-5, rtol=0)


def test_last_token_index():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 0]
    with pytest.raises(ValueError, match="all zeros"):
        last_token_index(torch.tensor([[1, 0], [0, 0]]))


def test_scorer_from_policy_and_from_paths(tmp_path, tokenizer):
    policy = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    policy.save_pretrained(tmp_path / "policy")
    from_object = reward_model_from_policy(policy, tokenizer.pad_token_id).eval()
    from_folder = load_reward_model(tmp_path / "policy")
    for model in (from_object, from_folder):
        assert torch.equal(model.model.embed_tokens.weight, policy.model.embed_tokens.weight)
        assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    # the fresh head is drawn from the seed, so two loads agree
    assert torch.equal(from_folder.score.weight, load_reward_model(tmp_path / "policy").score.weight)
    from_folder.save_pretrained(tmp_path / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    ids, mask = padded(ROWS, tokenizer.pad_token_id)
    with torch.no_grad():
        expected = sequence_scores(from_folder, ids, mask)
        torch.testing.assert_close(sequence_scores(plain, ids, mask), expected)
        torch.testing.assert_close(sequence_scores(load_reward_model(tmp_path / "rm"), ids, mask), expected)


def test_a_scorer_needs_a_pad_id(tmp_path, tokenizer):
    policy = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2)  # no tokenizer: no pad id
    policy.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no pad_token_id"):
        load_reward_model(tmp_path)
    assert load_reward_model(tmp_path, pad_token_id=0).config.pad_token_id == 0
    with pytest.raises(ValueError, match="pad_token_id"):
        build_reward_model(policy.config)
