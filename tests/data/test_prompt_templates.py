"""``data.prompt_template``: the text wraps every prompt for SFT, RL and evaluation alike, a
named template stands for its text, and a template without ``{prompt}`` is refused by key.
``data.chat_template``: text prompts become one user message, framed by the chat template."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.data.prompt_templates import R1_ZERO, apply_prompt_template, chat_rows, template_rows
from posttrain.evaluate import evaluate
from posttrain.models.chat import chat_prompt_ids
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.train.recipes import SFTRun, load_rows
from posttrain.train.rl_config import load_rl_config
from posttrain.train.sft import SFTObjective

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]


def test_the_r1_zero_template_is_the_lectures_wording():
    question = "Tom has 3 apples and buys 5 more. How many apples does Tom have?"
    text = apply_prompt_template(question, R1_ZERO)
    assert text.startswith("A conversation between User and Assistant. The User asks a question and")
    assert "<think> reasoning process here </think><answer> answer here </answer>." in text
    assert text.endswith(f"User: {question}. Assistant:")


def test_a_template_keeps_other_braces_and_templates_the_last_user_message():
    boxed = "Solve {prompt} and put it in \\boxed{}."
    assert apply_prompt_template("2+2", boxed) == "Solve 2+2 and put it in \\boxed{}."
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "1+1?"},
    ]
    templated = apply_prompt_template(messages, "Q: {prompt}")
    assert [m["content"] for m in templated] == ["hi", "hello", "Q: 1+1?"]
    assert messages[-1]["content"] == "1+1?"  # the row itself is left alone


def test_rows_keep_their_other_columns():
    rows = [{"prompt": "p", "answer": "7", "completion": "c"}, {"messages": [{"role": "user", "content": "m"}]}]
    out = template_rows(rows, "<{prompt}>")
    assert out[0] == {"prompt": "<p>", "answer": "7", "completion": "c"}
    assert out[1]["messages"][0]["content"] == "<m>"


def test_the_option_reaches_training_and_held_out_rows():
    base = [*TINY, "data.task=arithmetic", "data.n_train=3", "data.n_eval=2"]
    plain = load_rows(load_config(SFTRun, None, base).data, 0)
    named = load_rows(load_config(SFTRun, None, [*base, "data.prompt_template=r1_zero"]).data, 0)
    for plain_rows, templated_rows in zip(plain[:2], named[:2], strict=True):
        for before, after in zip(plain_rows, templated_rows, strict=True):
            assert after["prompt"] == apply_prompt_template(before["prompt"], R1_ZERO)
            assert after["completion"] == before["completion"] and after["answer"] == before["answer"]


@pytest.mark.parametrize("loader", ["sft", "rl"])
def test_a_template_without_the_placeholder_is_refused_naming_the_key(loader):
    overrides = [*TINY, "data.task=arithmetic", "data.prompt_template='Question: {question} Answer:'"]
    with pytest.raises(ConfigError) as error:
        load_config(SFTRun, None, overrides) if loader == "sft" else load_rl_config(None, overrides)
    assert "data.prompt_template" in str(error.value)
    assert "{prompt}" in str(error.value) and "r1_zero" in str(error.value)


def test_chat_template_makes_each_text_prompt_one_user_message():
    rows = [{"prompt": "2+2?", "answer": "4"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    out = chat_rows(rows)
    assert out[0] == {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    assert out[1] == rows[1] and rows[0]["prompt"] == "2+2?"


def test_chat_template_reaches_sft_encoding_and_evaluation():
    """After prompt_template, the prompt is a user message: SFT learns the assistant's turn after
    the chat template's framing, and evaluation generates from the same token ids."""
    base = [*TINY, "data.task=arithmetic", "data.n_train=2", "data.n_eval=3", "data.prompt_template=r1_zero"]
    train, held_out, _ = load_rows(load_config(SFTRun, None, [*base, "data.chat_template=true"]).data, 0)
    plain, _, _ = load_rows(load_config(SFTRun, None, base).data, 0)
    assert train[0]["prompt"] == [{"role": "user", "content": plain[0]["prompt"]}]

    tokenizer = build_char_tokenizer()
    ids, mask = SFTObjective(None, tokenizer).encode(train[0])
    framed = chat_prompt_ids(tokenizer, train[0]["prompt"])
    assert ids[: len(framed)] == framed and not any(mask[: len(framed)])
    assert tokenizer.decode(framed).endswith("<|assistant|>\n")  # the assistant's turn is open
    completion = tokenizer(train[0]["completion"], add_special_tokens=False)["input_ids"]
    assert ids[len(framed) :] == [*completion, tokenizer.eos_token_id] and all(mask[len(framed) :])

    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    seen = []

    def record(prompts, completions, completion_ids, **columns):
        seen.extend(prompts)
        return [0.0] * len(prompts)

    result = evaluate(model, tokenizer, held_out, record, max_new_tokens=4, batch_size=2)
    assert seen == [row["prompt"] for row in held_out] and len(result.samples) == 3
