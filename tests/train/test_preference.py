"""Reward-model and DPO objectives on easy, checkable preferences.

(The synthetic RLHF preference task, where ≥ 90% held-out accuracy is the bar, is tested with
the RLHF example; these tests check the objectives' mechanics on preferences a tiny model
learns in seconds.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from posttrain.data.tasks.reverse import make_prompt, split_names
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.train.offline import LoopConfig, train_offline
from posttrain.train.preference import DPOObjective, RewardModelObjective


def pairs(names):
    """Lower-case answers are preferred to the same answer shouted."""
    return [{"prompt": make_prompt(n), "chosen": f" {n[::-1]}.", "rejected": f" {n[::-1].upper()}."} for n in names]


@pytest.fixture(scope="module")
def data():
    train, test = split_names(400, 100, seed=1)
    return pairs(train), pairs(test)


def loop(tmp_path, **kw) -> LoopConfig:
    return LoopConfig(**{"batch_size": 16, "warmup_steps": 5, "output_dir": str(tmp_path), "log_every": 10**6, **kw})


@pytest.mark.slow
def test_reward_model_learns_the_preference(tmp_path, data):
    train_rows, test_rows = data
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    objective = RewardModelObjective(model, tokenizer)
    held_out = [objective.encode(row) for row in test_rows]
    before = objective.pairwise_accuracy(held_out)
    history = train_offline(objective, [objective.encode(r) for r in train_rows], loop(tmp_path, steps=80))
    after = objective.pairwise_accuracy(held_out)
    assert after >= 0.9 > before + 0.2, (before, after)
    assert history[-1]["rm/accuracy"] > history[0]["rm/accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_raises_the_chosen_over_rejected_margin(tmp_path, data, loss_type):
    train_rows, _ = data
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=64, heads=4, tokenizer=tokenizer)
    objective = DPOObjective(model, tokenizer, beta=0.1, loss_type=loss_type)
    examples = [objective.encode(r) for r in train_rows]
    history = train_offline(objective, examples, loop(tmp_path, steps=30, learning_rate=1e-3))
    assert history[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    margins = [h["dpo/margin"] for h in history]
    assert margins[-1] > 0.1 and margins[-1] > max(margins[:5]) and history[-1]["dpo/accuracy"] >= 0.9, margins
    for p in objective.reference.parameters():  # the frozen copy never moved
        assert not p.requires_grad


@pytest.mark.slow
def test_rpo_keeps_the_chosen_answers_likely_while_the_margin_grows(tmp_path, data):
    """RPO's NLL term (``nll_coef``) on top of DPO, from the same start: the chosen responses end
    likelier than under plain DPO, and the preference is learned as well."""
    train_rows, _ = data
    tokenizer = build_char_tokenizer()
    finals = {}
    for nll_coef in (0.0, 1.0):
        torch.manual_seed(0)
        model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=64, heads=4, tokenizer=tokenizer)
        objective = DPOObjective(model, tokenizer, beta=0.1, nll_coef=nll_coef)
        examples = [objective.encode(r) for r in train_rows]
        history = train_offline(objective, examples, loop(tmp_path / str(nll_coef), steps=30, learning_rate=1e-3))
        assert history[0]["dpo/nll"] == pytest.approx(finals.get("start", history[0]["dpo/nll"]), rel=1e-5)
        finals["start"] = history[0]["dpo/nll"]  # the same model and batch at step 1 either way
        finals[nll_coef] = history[-1]
    plain, rpo = finals[0.0], finals[1.0]
    # seed 0: NLL 4.49 nats/token at the start, 3.60 after plain DPO, 2.84 with the term
    assert rpo["dpo/nll"] < plain["dpo/nll"] - 0.4 and rpo["dpo/chosen"] > plain["dpo/chosen"], (plain, rpo)
    assert rpo["dpo/margin"] > 0.5 and rpo["dpo/accuracy"] >= 0.9, rpo
