import math

import pytest
import torch

from posttrain.data.tasks.reverse import make_rows, reverse_reward
from posttrain.evaluate import SampledResult, evaluate, generate_greedy, pass_at_k, sampled_eval, standard_error
from posttrain.models.chat import prompt_ids
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=1, tokenizer=tokenizer)


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(model, tokenizer):
    prompts = [row["prompt"] for row in make_rows(["al", "sanidhya", "joe", "akshitaxy"])]
    texts, ids = generate_greedy(model, tokenizer, prompts, max_new_tokens=6, batch_size=4)
    for prompt, text, row_ids in zip(prompts, texts, ids, strict=True):
        alone_texts, alone_ids = generate_greedy(model, tokenizer, [prompt], max_new_tokens=6)
        assert (alone_texts[0], alone_ids[0]) == (text, row_ids)
        assert tokenizer.decode(row_ids, skip_special_tokens=True) == text
        assert len(row_ids) == 6 or row_ids[-1] == tokenizer.eos_token_id


def test_completion_ids_stop_at_eos_and_the_mode_is_restored(tokenizer):
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=1, tokenizer=tokenizer)
    with torch.no_grad():  # make EOS the argmax after any token: every completion is just EOS
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.eos_token_id] = 1.0
        model.model.norm.weight.fill_(1.0)
    model.model.embed_tokens.weight.data.abs_()
    model.train()
    texts, ids = generate_greedy(model, tokenizer, ["x", "longer prompt"], max_new_tokens=5)
    assert ids == [[tokenizer.eos_token_id]] * 2 and texts == ["", ""]
    assert model.training  # the mode it had is given back


def test_evaluate_scores_and_passes_columns_like_trl(model, tokenizer):
    rows = make_rows(["sean", "neel"])
    seen = {}

    def reward_fn(prompts, completions, completion_ids, **columns):
        seen.update(columns, prompts=prompts, n_ids=len(completion_ids))
        return [1.0, None]

    result = evaluate(model, tokenizer, rows, reward_fn, max_new_tokens=3)
    assert seen["name"] == ["sean", "neel"] and "completion" not in seen and seen["n_ids"] == 2
    assert result.accuracy == 1.0  # None rows are left out of the mean
    assert result.samples[0]["reference"] == " naes." and result.samples[1]["reward"] is None


def test_accuracy_is_the_mean_reward_of_the_completions_hf_generate_gives(model, tokenizer):
    # Hugging Face's own greedy decoding, one prompt at a time, is the reference; the engine never
    # samples the pad token (it would read as padding), so neither does the reference
    rows = make_rows(["sean", "joel", "chen", "akshitaxy"])
    expected = []
    for row in rows:
        ids = torch.tensor([prompt_ids(tokenizer, row["prompt"])])
        out = model.generate(
            ids,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            suppress_tokens=[tokenizer.pad_token_id],
        )
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert len(set(expected)) > 1  # distinct completions: a mix-up of rows would show
    # rows 0 and 2 are scored against the model's own output, rows 1 and 3 against a changed one
    targets = [text if i % 2 == 0 else text + "x" for i, text in enumerate(expected)]

    def exact(prompts, completions, completion_ids, target, **columns):
        return [float(c == t) for c, t in zip(completions, target, strict=True)]

    result = evaluate(model, tokenizer, [{**r, "target": t} for r, t in zip(rows, targets, strict=True)], exact)
    assert [s["completion"] for s in result.samples] == expected
    assert [s["reward"] for s in result.samples] == [1.0, 0.0, 1.0, 0.0] and result.accuracy == 0.5


def test_stop_strings_end_greedy_completions_as_in_rl_sampling(model, tokenizer):
    rows = make_rows(["sean", "akshitaxy"])
    free = evaluate(model, tokenizer, rows, reverse_reward, max_new_tokens=12).samples
    stop = free[0]["completion"][3:5]  # two characters the untrained model writes mid-completion
    stopped = evaluate(model, tokenizer, rows, reverse_reward, max_new_tokens=12, stop=[stop]).samples
    for before, after in zip(free, stopped, strict=True):
        cut = before["completion"].find(stop)
        expected = before["completion"] if cut < 0 else before["completion"][: cut + len(stop)]
        assert after["completion"] == expected
    assert len(stopped[0]["completion"]) < len(free[0]["completion"])


def test_pass_at_k_ends_sampled_completions_at_stop_strings(model, tokenizer):
    # pass@k used to ignore the stop strings that greedy evaluation and RL sampling apply
    rows = make_rows(["sean", "akshitaxy", "joe"])
    seen: dict[str, list[str]] = {"free": [], "stopped": []}

    def recorder(name):
        def reward(prompts, completions, completion_ids, **columns):
            seen[name].extend(completions)
            return reverse_reward(prompts, completions, completion_ids, **columns)

        return reward

    pass_at_k(model, tokenizer, rows, recorder("free"), k=4, max_new_tokens=12, seed=3)
    stop = max("abcdefghijklmnopqrstuvwxyz", key=lambda c: sum(c in t[:-1] for t in seen["free"]))
    assert sum(stop in t[:-1] for t in seen["free"]) >= 2  # the stop string occurs mid-completion unstopped
    pass_at_k(model, tokenizer, rows, recorder("stopped"), k=4, max_new_tokens=12, seed=3, stop=[stop])
    assert len(seen["stopped"]) == 12
    assert all(stop not in text[:-1] for text in seen["stopped"])
    assert any(text.endswith(stop) for text in seen["stopped"])


def test_sampled_eval_gives_pass_and_mean_at_k_with_errors_over_prompts(model, tokenizer):
    rows = make_rows(["sean", "akshitaxy", "joe"])
    given = iter([[1.0, 0.0], [0.0, None], [1.0, 1.0]])  # per prompt, k = 2; None: not applicable

    def scripted(prompts, completions, completion_ids, **columns):
        assert len(completions) == 6 and prompts[0] == prompts[1] != prompts[2]  # prompt-major samples
        return [score for _ in range(3) for score in next(given)]

    result = sampled_eval(model, tokenizer, rows, scripted, k=2, max_new_tokens=4, seed=1)
    assert result.scores == [[1.0, 0.0], [0.0], [1.0, 1.0]]
    assert result.pass_at_k == pytest.approx(2 / 3)
    assert result.mean_at_k == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    # the prompts are the draws: the spread of their means, 0.5, over √3
    assert result.mean_at_k_stderr == pytest.approx(0.5 / 3**0.5)


def test_sampled_eval_batch_size_bounds_the_sequences_in_flight(model, tokenizer, monkeypatch):
    """k samples of each prompt are sequences of their own: a batch of 256 prompts with k = 4 once
    held the KV cache of 1024 sequences (10 GiB on SmolLM2 with eval_batch_size 300)."""
    import posttrain.evaluate as evaluation

    real, in_flight = evaluation.build_engine, []

    def counting(*args, **kwargs):
        engine = real(*args, **kwargs)
        generate = engine.generate

        def recorded(chunk, sampling):
            in_flight.append(len(chunk) * sampling.n)
            return generate(chunk, sampling)

        engine.generate = recorded
        return engine

    monkeypatch.setattr(evaluation, "build_engine", counting)
    rows = make_rows(["sean", "akshitaxy", "joe", "al", "bo"])
    whole = sampled_eval(model, tokenizer, rows, reverse_reward, k=3, max_new_tokens=4, seed=1, batch_size=100)
    assert in_flight == [15]
    in_flight.clear()
    sampled_eval(model, tokenizer, rows, reverse_reward, k=3, max_new_tokens=4, seed=1, batch_size=7)
    assert in_flight == [6, 6, 3]  # 2 prompts (6 sequences) per batch, then the last
    in_flight.clear()
    sampled_eval(model, tokenizer, rows, reverse_reward, k=3, max_new_tokens=4, seed=1, batch_size=2)
    assert in_flight == [3] * 5  # never less than one prompt's k samples
    assert len(whole.scores) == 5


def test_standard_errors():
    assert standard_error([1.0, 0.0, 1.0, 0.0]) == pytest.approx((1 / 3) ** 0.5 / 2)
    assert math.isnan(standard_error([1.0]))
    assert math.isnan(SampledResult(k=4, scores=[]).mean_at_k)


def test_eval_command_on_a_data_file_reports_greedy_and_sampled_figures(model, tokenizer, tmp_path, capsys):
    import json

    from posttrain.cli import main

    folder, data = tmp_path / "model", tmp_path / "rows.jsonl"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = make_rows(["sean", "akshitaxy", "joe", "al"])
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["eval", "--model", str(folder), "--data", str(data), "--n", "3", "--k", "2", "--max-new-tokens", "8"]
    assert main([*args, "--reward", "reverse", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    greedy = evaluate(model, tokenizer, rows[:3], reverse_reward, max_new_tokens=8)
    sampled = sampled_eval(model, tokenizer, rows[:3], reverse_reward, k=2, max_new_tokens=8, seed=0)
    assert report == {
        "data": str(data), "rows": 3, "greedy_accuracy": greedy.accuracy, "greedy_accuracy_stderr": greedy.stderr,
        "pass@2": sampled.pass_at_k, "mean@2": sampled.mean_at_k, "mean@2_stderr": sampled.mean_at_k_stderr,
    }  # fmt: skip
    # a data file brings no reward of its own: refused before the model loads, naming what to pass
    assert main(args) == 2
    assert "has no reward to score with; pass --reward" in capsys.readouterr().err
