"""SFT on a recorded tool-using conversation trains every assistant turn — the tool call as
much as the final answer — and no user or tool token, in the context RL shows (the tools listed by
the template, the result where the template writes it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.envs.conversation import conversation_example
from posttrain.envs.episode import TemplatePrefixError
from posttrain.models.chat import chat_prompt_ids
from posttrain.models.tokenizers import DEFAULT_CHARSET, build_char_tokenizer
from posttrain.train.sft import SFTObjective

TEMPLATE = Path(__file__).parent / "templates" / "hermes.jinja"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "5", "name": "add"},
    {"role": "assistant", "content": "It is 5."},
]


@pytest.fixture
def tokenizer():
    tokenizer = build_char_tokenizer(DEFAULT_CHARSET + '{}[]"#')
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def test_every_assistant_turn_is_trained_and_nothing_else(tokenizer):
    ids, mask = SFTObjective(None, tokenizer).encode({"messages": CONVERSATION, "tools": TOOLS})
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert trained == CALL + "<eos>" + "It is 5." + "<eos>"
    context = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "# Tools" in context and '"name": "add"' in context  # the tools the template lists
    assert "<tool_response>\n5\n</tool_response>" in context and "What is 2 + 3?" in context
    # the first trained token follows exactly the prompt RL samples the first turn from
    prompt = chat_prompt_ids(tokenizer, CONVERSATION[:1], tools=TOOLS)
    assert ids[: len(prompt)] == prompt and mask.index(1) == len(prompt)


def test_a_conversation_of_one_answer_is_trained_as_before(tokenizer):
    ids, mask = conversation_example(tokenizer, [*CONVERSATION[:1], {"role": "assistant", "content": "5"}])
    prompt = chat_prompt_ids(tokenizer, CONVERSATION[:1])
    assert ids == [*prompt, *tokenizer("5", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert mask == [0] * len(prompt) + [1, 1]


def test_a_template_that_rewrites_an_earlier_turn_is_refused_naming_it(tokenizer):
    # drops every assistant turn but the last, as reasoning templates drop earlier thoughts
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(TemplatePrefixError, match="turn"):
        conversation_example(tokenizer, CONVERSATION)


def test_a_conversation_without_an_assistant_turn_is_refused(tokenizer):
    with pytest.raises(ValueError, match="at least one assistant message"):
        conversation_example(tokenizer, CONVERSATION[:1])


ARGUMENTS = [{"a": 2, "b": 3}, '{"a": 2, "b": 3}']  # TRL's datasets give an object, OpenAI's API a JSON string


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=["object", "json string"])
@pytest.mark.parametrize("content", ["", None])
def test_a_call_turn_in_openai_form_trains_the_call_as_the_model_writes_it(tokenizer, arguments, content):
    """Hardening 3, item 12: an assistant turn with tool_calls and empty content trained only the stop
    token, so a standard tool-calling dataset taught the model to stop where it should call."""
    call = {"type": "function", "function": {"name": "add", "arguments": arguments}}
    conversation = [CONVERSATION[0], {"role": "assistant", "content": content, "tool_calls": [call]}, *CONVERSATION[2:]]
    as_text = SFTObjective(None, tokenizer).encode({"messages": CONVERSATION, "tools": TOOLS})
    assert SFTObjective(None, tokenizer).encode({"messages": conversation, "tools": TOOLS}) == as_text


def test_a_call_turn_in_openai_form_passes_the_data_check_and_a_malformed_one_is_named():
    from posttrain.data import DataError, validate_rows

    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    good = {"messages": [CONVERSATION[0], turn, *CONVERSATION[2:]]}
    assert len(validate_rows([good], source="calls.jsonl", data_format="conversational").kept) == 1
    for bad_call, shown in [({"function": {"name": "add", "arguments": "{not json"}}, "call 0"), ("add", "call 0")]:
        bad = {"messages": [CONVERSATION[0], {"role": "assistant", "content": "", "tool_calls": [bad_call]}]}
        with pytest.raises(DataError, match=f"row 0, field 'messages': message 1, {shown}"):
            validate_rows([bad], source="calls.jsonl", data_format="conversational")
