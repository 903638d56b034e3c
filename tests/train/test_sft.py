import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.data.loading import DataError
from posttrain.data.tasks.reverse import make_rows, split_names
from posttrain.models.logprobs import token_logprobs
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.offline import LoopConfig, train_offline
from posttrain.train.sft import SFTObjective, collate, encode_row, sft_batch_loss


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def small_model(tokenizer, seed=0):
    return build_tiny_causal_lm(len(tokenizer), layers=1, hidden=64, heads=4, seed=seed, tokenizer=tokenizer)


def test_encode_row_masks_prompt_and_keeps_completion_and_eos(tokenizer):
    ids, mask = encode_row(tokenizer, "Reverse the name: sean. Answer:", " naes.")
    n_prompt = len("Reverse the name: sean. Answer:")
    assert ids[0] != tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert mask == [0] * n_prompt + [1] * (len(" naes.") + 1)
    assert tokenizer.decode(ids[n_prompt:], skip_special_tokens=True) == " naes."


def test_collate_pads_on_the_right(tokenizer):
    batch = collate([([5, 6, 7], [0, 1, 1]), ([8], [1])], pad_token_id=tokenizer.pad_token_id)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_batch_loss_counts_only_completion_tokens(tokenizer):
    model = small_model(tokenizer)
    rows = make_rows(["sean", "akshita"])
    examples = [encode_row(tokenizer, r["prompt"], r["completion"]) for r in rows]
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        loss = sft_batch_loss(model, batch)
        # By hand, one unpadded row at a time: NLL of the completion tokens and EOS only.
        nll, count = 0.0, 0
        for ids, mask in examples:
            ids_t = torch.tensor([ids])
            logprobs = token_logprobs(model(ids_t).logits[:, :-1], ids_t[:, 1:])[0]
            picked = [lp for lp, m in zip(logprobs.tolist(), mask[1:], strict=True) if m]
            nll -= sum(picked)
            count += len(picked)
        all_tokens = -sum(
            token_logprobs(model(torch.tensor([ids])).logits[:, :-1], torch.tensor([ids[1:]])).sum().item()
            for ids, _ in examples
        ) / sum(len(ids) - 1 for ids, _ in examples)
    assert count == len(" naes.") + 1 + len(" atihska.") + 1
    assert loss.item() == pytest.approx(nll / count, rel=1e-5)
    assert abs(loss.item() - all_tokens) > 1e-3  # the check above could tell a prompt-inclusive loss apart


def train(model, tokenizer, rows, tmp_path, name="run", on_step=None, evaluate=None, **loop):
    """SFT through the one offline loop, as the demo and ``posttrain sft`` run it."""
    objective = SFTObjective(model, tokenizer)
    config = LoopConfig(output_dir=str(tmp_path / name), report_to=[], **loop)
    examples = [objective.encode(row) for row in rows]
    return train_offline(objective, examples, config, on_step=on_step, evaluate=evaluate, show_progress=False)


def test_warmup_then_constant_learning_rate(tokenizer, tmp_path):
    rows = make_rows(split_names(8, 9, seed=0)[0])
    history = train(
        small_model(tokenizer), tokenizer, rows, tmp_path, steps=7, batch_size=4, learning_rate=0.01, warmup_steps=4
    )
    assert [h["lr"] for h in history] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01, 0.01])
    assert [h["step"] for h in history] == list(range(1, 8))


def test_same_seed_same_losses_and_the_hook_sees_and_extends_every_step(tokenizer, tmp_path):
    rows = make_rows(split_names(64, 9, seed=0)[0])
    seen = []

    def hook(step, metrics):
        metrics["eval/hook_step"] = float(step)  # a metric of the caller's own, logged with the step
        seen.append((step, dict(metrics)))

    first = train(small_model(tokenizer), tokenizer, rows, tmp_path, "a", hook, steps=4, batch_size=8, seed=3)
    second = train(small_model(tokenizer), tokenizer, rows, tmp_path, "b", steps=4, batch_size=8, seed=3)
    other = train(small_model(tokenizer), tokenizer, rows, tmp_path, "c", steps=4, batch_size=8, seed=4)
    assert [(step, metrics) for step, metrics in seen] == [
        (h["step"], {k: v for k, v in h.items() if k != "step"}) for h in first
    ]
    logged = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "eval/hook_step" in r]
    assert [r["eval/hook_step"] for r in logged] == [1.0, 2.0, 3.0, 4.0]
    assert [h["loss/sft"] for h in first] == [h["loss/sft"] for h in second]
    assert [h["loss/sft"] for h in first] != [h["loss/sft"] for h in other]


def test_the_hook_stops_training_and_the_stop_step_ends_like_a_last_step(tokenizer, tmp_path):
    rows = make_rows(split_names(64, 9, seed=0)[0])
    model = small_model(tokenizer)
    evaluations = []

    def evaluate():
        evaluations.append(len(evaluations))
        return {"calls": float(len(evaluations))}

    history = train(
        model,
        tokenizer,
        rows,
        tmp_path,
        "stop",
        lambda step, m: step == 3,
        evaluate,
        steps=50,
        batch_size=8,
        save_every=2,
    )
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[-1]["eval/calls"] == 2.0  # before training, then once more after the stop step
    run = tmp_path / "stop"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-3"]
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    for name, tensor in model.state_dict().items():
        assert torch.equal(final.state_dict()[name], tensor), name
    final_eval = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/calls" in r]
    assert [(r["step"], r["eval/calls"]) for r in final_eval] == [(0, 1.0), (3, 2.0)]


def test_too_few_rows_for_a_batch_is_an_error(tokenizer, tmp_path):
    with pytest.raises(DataError, match="batch"):
        train(small_model(tokenizer), tokenizer, make_rows(["sean"]), tmp_path, steps=1, batch_size=2)


@pytest.mark.slow
def test_short_real_run_lowers_the_loss(tokenizer, tmp_path):
    rows = make_rows(split_names(4000, 9, seed=0)[0])
    model = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=128, heads=4, tokenizer=tokenizer)
    history = train(model, tokenizer, rows, tmp_path, steps=150, batch_size=32, warmup_steps=10)
    first = sum(h["loss/sft"] for h in history[:10]) / 10
    last = sum(h["loss/sft"] for h in history[-10:]) / 10
    assert first > 3.0  # near log(74): the untrained model spreads its guesses over every character
    # Knowing the format but not the reversal plateaus near 1.6 (a guess among a name's letters);
    # below 0.6 the model has started to reverse. Seen: 0.15-0.26.
    assert last < 0.6, (first, last)
