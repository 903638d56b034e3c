"""The offline loop: exact resume, accumulation invariance, NaN handling, run directory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.data.tasks.reverse import make_rows, split_names
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.run.checkpoint import latest_checkpoint
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.offline import LoopConfig, TrainingDiverged, train_offline
from posttrain.train.schedule import lr_multiplier
from posttrain.train.sft import SFTObjective


def setup(seed: int = 0):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=seed, tokenizer=tokenizer)
    objective = SFTObjective(model, tokenizer)
    names, _ = split_names(64, 9, seed=0)
    return objective, [objective.encode(row) for row in make_rows(names)]


def config(tmp_path, **overrides) -> LoopConfig:
    base = {
        "steps": 20,
        "batch_size": 8,
        "learning_rate": 3e-3,
        "warmup_steps": 3,
        "lr_scheduler": "cosine",
        "output_dir": str(tmp_path),
        "log_every": 1000,
    }
    return LoopConfig(**{**base, **overrides})


class StopAt:
    """Wraps an objective and raises at a given step, like a killed run."""

    def __init__(self, objective, stop_call: int):
        self.inner, self.calls, self.stop_call = objective, 0, stop_call
        self.model, self.tokenizer, self.loss_name = objective.model, objective.tokenizer, objective.loss_name

    def units(self, examples):
        return self.inner.units(examples)

    def loss(self, examples, step_units):
        self.calls += 1
        if self.calls == self.stop_call:
            raise KeyboardInterrupt
        return self.inner.loss(examples, step_units)


def losses(history):
    return [h["loss/sft"] for h in history]


def test_resume_is_bitwise_exact(tmp_path):
    objective, examples = setup()
    straight = losses(train_offline(objective, examples, config(tmp_path / "straight")))

    objective, examples = setup()
    with pytest.raises(KeyboardInterrupt):
        train_offline(StopAt(objective, 11), examples, config(tmp_path / "resumed", save_every=5))
    assert latest_checkpoint(tmp_path / "resumed").step == 10
    fresh, examples = setup(seed=123)  # different initial weights: the checkpoint must win
    second = train_offline(fresh, examples, config(tmp_path / "resumed", save_every=5, resume="auto"))
    assert [h["step"] for h in second] == list(range(11, 21))
    assert losses(second) == straight[10:]  # bitwise, not approximately
    logged = [r for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if "loss/sft" in r]
    assert [r["step"] for r in logged] == list(range(1, 21))


def test_gradient_accumulation_does_not_change_the_step(tmp_path):
    objective, examples = setup()
    whole = losses(train_offline(objective, examples, config(tmp_path / "a", steps=4)))
    objective, examples = setup()
    split = losses(train_offline(objective, examples, config(tmp_path / "b", steps=4, gradient_accumulation=4)))
    # the same step whatever the split: equal up to the rounding of summing in another order
    torch.testing.assert_close(torch.tensor(split), torch.tensor(whole), rtol=1e-5, atol=1e-6)


def test_nan_loss_stops_with_a_message_and_keeps_the_last_checkpoint(tmp_path):
    objective, examples = setup()

    class NaNAtStep3(StopAt):
        def loss(self, examples, step_units):
            self.calls += 1
            loss, metrics = self.inner.loss(examples, step_units)
            return (loss * float("nan") if self.calls == 3 else loss), metrics

    with pytest.raises(TrainingDiverged, match=r"step 3: the loss is nan.*Lower learning_rate"):
        train_offline(NaNAtStep3(objective, 0), examples, config(tmp_path, save_every=2))
    assert latest_checkpoint(tmp_path).step == 2


def test_run_directory_holds_config_metrics_checkpoint_and_final(tmp_path):
    objective, examples = setup()
    train_offline(
        objective, examples, config(tmp_path, steps=3), config_yaml="steps: 3\n", evaluate=lambda: {"accuracy": 0.5}
    )
    assert (tmp_path / "config.yaml").read_text() == "steps: 3\n"
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert records[0] == {"step": 0, "eval/accuracy": 0.5} and records[-1]["eval/accuracy"] == 0.5
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    trained = objective.model.state_dict()
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[name], trained[name]) for name in trained)  # the trained weights, not a fresh init
    assert latest_checkpoint(tmp_path).step == 3


def test_the_logged_learning_rate_follows_the_schedule(tmp_path):
    # the rate the optimizer used at each step, as logged: base × lr_multiplier(step − 1)
    objective, examples = setup()
    history = train_offline(objective, examples, config(tmp_path, steps=8, min_lr_ratio=0.1))
    factor = lr_multiplier("cosine", 3, 8, 0.1)
    assert [h["lr"] for h in history] == pytest.approx([3e-3 * factor(s) for s in range(8)])
    assert history[0]["lr"] == pytest.approx(1e-3) and history[-1]["lr"] < history[3]["lr"]
