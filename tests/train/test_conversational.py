"""TRL's conversational data end to end (issue 23, item 9): preference and prompt/completion rows
given as chat messages train through ``posttrain rm | dpo | sft``, and reward functions written
for TRL's GRPOTrainer run unchanged on standard and conversational prompts alike."""

from __future__ import annotations

import json
import math
import re

import pytest

from posttrain.cli import main
from posttrain.models.chat import chat_prompt_ids
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rewards.registry import NamedReward
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.preference import encode_pair
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
NAMES = ["ann", "bob", "cyd", "dee", "eve", "fay", "gus", "hal"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------- reward functions as TRL's docs write them
# (https://huggingface.co/docs/trl/grpo_trainer, "Using a custom reward function"), copied unchanged


def reward_len(completions, **kwargs):
    """Standard format: completions are strings."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Conversational format: each completion is a list of messages."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def content_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


def reward_ground_truth(prompts, completions, ground_truth, **kwargs):
    """An extra dataset column arrives as a keyword argument; conversational completions."""
    return [
        float(gt in completion[0]["content"]) + len(prompt)
        for prompt, completion, gt in zip(prompts, completions, ground_truth, strict=True)
    ]


def reward_ground_truth_text(prompts, completions, ground_truth, **kwargs):
    return [
        float(gt in completion) + len(prompt) / 100
        for prompt, completion, gt in zip(prompts, completions, ground_truth, strict=True)
    ]


class Recorder:
    """Calls a TRL-style reward function unchanged and keeps what it was given."""

    def __init__(self, fn):
        self.fn, self.__name__, self.calls = fn, fn.__name__, []

    def __call__(self, prompts, completions, completion_ids, **columns):
        self.calls.append((prompts, completions, columns))
        return self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)


def run_rl(tmp_path, rows, functions):
    tmp_path.mkdir()
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    overrides = [*TINY, f"data.path={data}", f"data.eval_path={data}", "eval_size=4", "eval_every=1"]
    overrides += ["prompts_per_step=4", "samples_per_prompt=2", "max_new_tokens=5", "steps=2", "log_every=100"]
    overrides += ["reward_workers=0", "preflight=false", f"output_dir={tmp_path / 'run'}"]
    config = load_rl_config(None, overrides)
    recorders = [fn if isinstance(fn, NamedReward) else Recorder(fn) for fn in functions]
    history = OnlineRL(config, reward_functions=recorders, echo=lambda line: None).run()
    return history, recorders


def test_trl_reward_functions_run_unchanged_on_standard_and_conversational_prompts(tmp_path):
    from posttrain.rewards import resolve_reward

    # conversational prompts: completions arrive as [{"role": "assistant", "content": text}]
    rows = [{"prompt": [user(f"Reverse {name}.")], "ground_truth": name[::-1], "answer": name} for name in NAMES]
    functions = [format_reward_func, content_len, reward_ground_truth]
    history, recorders = run_rl(
        tmp_path / "chat", rows, [*functions, resolve_reward("exact_match"), resolve_reward("length")]
    )
    for recorder in recorders[:3]:
        assert len(recorder.calls) >= 3  # the evaluations and the training steps
        for prompts, completions, columns in recorder.calls:
            assert all(p in [row["prompt"] for row in rows] for p in prompts)
            for completion in completions:  # exactly TRL's shape: one assistant message
                assert isinstance(completion, list) and len(completion) == 1
                assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
            assert set(columns) == {"ground_truth", "answer"}
    # the logged mean is the function's own value on what it was given (calls: eval, step 1, ...)
    prompts, completions, columns = recorders[1].calls[1]
    expected = [-abs(20 - len(c[0]["content"])) for c in completions]
    assert history[0]["reward/content_len/mean"] == pytest.approx(sum(expected) / len(expected))
    # built-in rewards read the same messages: no reply of <= 5 characters is 100 long or a name
    assert history[0]["reward/exact_match/mean"] == 0.0
    lengths = [len(c[0]["content"]) for c in completions]
    assert history[0]["reward/length/mean"] == pytest.approx(sum(-abs(n - 100) / 100 for n in lengths) / len(lengths))
    assert all(math.isfinite(h["loss/total"]) for h in history)

    # standard prompts: the same loop hands TRL's standard-format functions plain strings
    rows = [{"prompt": f"Reverse {name}.", "ground_truth": name[::-1]} for name in NAMES]
    history, recorders = run_rl(tmp_path / "text", rows, [reward_len, reward_ground_truth_text])
    for recorder in recorders:
        for prompts, completions, columns in recorder.calls:
            assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
            assert set(columns) == {"ground_truth"}
    prompts, completions, columns = recorders[0].calls[1]
    expected = [-abs(20 - len(c)) for c in completions]
    assert history[0]["reward/reward_len/mean"] == pytest.approx(sum(expected) / len(expected))


def test_an_rl_prompt_the_chat_template_refuses_is_one_message_naming_the_row(tmp_path, capsys):
    from posttrain.data import DataError
    from posttrain.models.tiny import build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    # as Gemma's and Mistral's templates do for a role they do not know
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    rows = [{"prompt": [user(f"Reverse {name}.")]} for name in NAMES]
    rows[2]["prompt"] = [{"role": "system", "content": "Be brief."}, *rows[2]["prompt"]]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    overrides = [*TINY, f"data.path={data}", "prompts_per_step=4", "reward_workers=0", f"output_dir={tmp_path / 'o'}"]
    config = load_rl_config(None, overrides)
    expected = f"{data}, row 2 (line 3): the tokenizer's chat template refuses this conversation: System role not"
    with pytest.raises(DataError, match=re.escape(expected)):
        OnlineRL(config, model=model, tokenizer=tokenizer, reward_functions=[reward_len], echo=lambda line: None)


# ---------------------------------------------------------------- preference rows as messages


def explicit_rows():
    return [
        {"prompt": [user(f"Describe {name}.")], "chosen": [assistant("nice calm")], "rejected": [assistant("bad")]}
        for name in NAMES
    ]


def implicit_rows():
    return [
        {
            "chosen": [user(f"Describe {name}."), assistant("nice calm")],
            "rejected": [user(f"Describe {name}."), assistant("bad")],
        }
        for name in NAMES
    ]


def test_a_conversational_pair_encodes_as_the_rollout_would_produce_it():
    tokenizer = build_char_tokenizer()
    pair = encode_pair(tokenizer, explicit_rows()[0])
    prompt = chat_prompt_ids(tokenizer, [user("Describe ann.")])
    chosen = tokenizer("nice calm", add_special_tokens=False)["input_ids"]
    assert pair.chosen == (prompt + chosen + [tokenizer.eos_token_id], [0] * len(prompt) + [1] * (len(chosen) + 1))
    rejected = tokenizer("bad", add_special_tokens=False)["input_ids"]
    assert pair.rejected[0] == prompt + rejected + [tokenizer.eos_token_id]


@pytest.mark.parametrize("command", ["rm", "dpo"])
@pytest.mark.parametrize("form", ["explicit", "implicit"])
def test_rm_and_dpo_train_on_conversational_preference_rows(tmp_path, command, form):
    data = write_jsonl(tmp_path / "pairs.jsonl", explicit_rows() if form == "explicit" else implicit_rows())
    argv = [command, *TINY, f"data.path={data}", "steps=2", "batch_size=4", f"output_dir={tmp_path / 'out'}"]
    assert main(argv) == 0
    loss = "loss/rm" if command == "rm" else "loss/dpo"
    losses = [r[loss] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if loss in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    if command == "dpo":  # the policy starts as the reference: margin 0, loss log 2
        assert losses[0] == pytest.approx(math.log(2), abs=1e-5)


def test_implicit_and_explicit_prompts_train_identically(tmp_path):
    finals = {}
    for form, rows in (("explicit", explicit_rows()), ("implicit", implicit_rows())):
        data = write_jsonl(tmp_path / f"{form}.jsonl", rows)
        argv = ["dpo", *TINY, f"data.path={data}", "steps=2", "batch_size=4", f"output_dir={tmp_path / form}"]
        assert main(argv) == 0
        finals[form] = [r for r in read_jsonl(tmp_path / form / "metrics.jsonl") if "loss/dpo" in r][-1]["loss/dpo"]
    assert finals["implicit"] == finals["explicit"]


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        # the pair's responses start with another user turn: not two answers to one prompt
        ({"prompt": [user("Hi.")], "chosen": [user("Hi."), assistant("yes")], "rejected": [assistant("no")]},
         "field 'chosen'"),
        # an implicit prompt is the messages both sides open with; these share none
        ({"chosen": [user("a"), assistant("yes")], "rejected": [user("b"), assistant("no")]}, "no opening message"),
        # one side is the other's prompt: nothing left to prefer
        ({"chosen": [user("a"), assistant("yes")],
          "rejected": [user("a"), assistant("yes"), user("b"), assistant("c")]}, "field 'chosen'"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_a_broken_conversational_row_is_one_message_with_file_and_row(tmp_path, capsys, command, row, expected):
    data = write_jsonl(tmp_path / "pairs.jsonl", [*explicit_rows()[:3], row])
    argv = [command, *TINY, f"data.path={data}", "steps=1", "batch_size=2", f"output_dir={tmp_path / 'out'}"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posttrain {command}: {data}, row 3 (line 4)") and expected in err, err
    assert "Traceback" not in err


def test_a_chat_template_that_opens_the_reply_otherwise_is_refused_naming_the_row(tmp_path, capsys):
    from posttrain.models.tiny import build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    # the generation prompt says "<|bot|>" but a written reply is introduced by "<|assistant|>": a
    # reply learnt after the first would never be what the template shows the model
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|bot|>{% endif %}"
    )
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "pairs.jsonl", explicit_rows())
    argv = ["dpo", f"model.path={tmp_path / 'model'}", f"data.path={data}", "steps=1", "batch_size=2"]
    capsys.readouterr()
    assert main([*argv, f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the weights' loading bar
    assert err.startswith(f"posttrain dpo: {data}, row 0 (line 1): the chat template writes the prompt differently")
    assert "'bot|>'" in err and "'assistant|>nice calm" in err
    # rows skipped by validation do not shift the row named (nor does a blank line the line)
    bad = {"prompt": [user("Hi.")], "chosen": [assistant("yes")]}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(bad) + "\n\n" + data.read_text())
    assert main([*argv, "data.on_bad_row=skip", f"output_dir={tmp_path / 'out2'}"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"posttrain dpo: {data}, row 1 (line 3): the chat template writes the prompt differently")


def test_sft_trains_on_conversational_prompt_completion_rows(tmp_path):
    rows = [{"prompt": [user(f"Say {name}.")], "completion": [assistant(name)]} for name in NAMES]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    argv = ["sft", *TINY, f"data.path={data}", "steps=2", "batch_size=4", f"output_dir={tmp_path / 'out'}"]
    assert main(argv) == 0
    losses = [r["loss/sft"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss/sft" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
