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


def _long_conversation(turns: int) -> list[dict]:
    conversation = [CONVERSATION[0]]
    for _ in range(turns):
        conversation += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5", "name": "add"}]
    return [*conversation, CONVERSATION[-1]]


def _counting_renders(tokenizer) -> list[int]:
    renders = [0]
    render = tokenizer.apply_chat_template

    def counted(*args, **kwargs):
        renders[0] += 1
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = counted
    return renders


@pytest.mark.parametrize("stop_written", [False, True], ids=["bare eos", "template writes the stop"])
def test_the_measured_length_is_the_assembled_one_or_below_and_the_limit_is_exact(tokenizer, stop_written):
    if stop_written:  # the template ends each assistant turn with the stop token the turn samples
        tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<eos>")
        assert "<eos>" in tokenizer.chat_template
    conversation = _long_conversation(3)
    ids, mask = conversation_example(tokenizer, conversation, tools=TOOLS)
    assert conversation_example(tokenizer, conversation, tools=TOOLS, max_tokens=len(ids)) == (ids, mask)
    measured, nothing = conversation_example(tokenizer, conversation, tools=TOOLS, max_tokens=1)
    assert not any(nothing) and len(nothing) == len(measured)
    # the bare <eos> after each of the 4 turns but the last is one token the template does not write
    assert len(measured) == len(ids) - (0 if stop_written else 4 - 1)
    assert measured == ids if stop_written else len(measured) < len(ids)


def test_a_conversation_longer_than_max_length_is_measured_once_not_assembled(tokenizer, tmp_path):
    """Hardening 3, item 5: agent-SFT encoding was quadratic in a row's turns (800 turns: 23 s,
    110x the time of 75), every turn rendering the whole conversation twice, before the row was
    refused as longer than the context anyway: now it is measured by one rendering first."""
    from posttrain.data import DataError
    from posttrain.train.recipes import DataSection, encode_within_context

    renders = _counting_renders(tokenizer)
    objective = SFTObjective(None, tokenizer)
    rows = [{"messages": _long_conversation(800), "tools": TOOLS}]
    section = DataSection(path=str(tmp_path / "agent.jsonl"))
    with pytest.raises(DataError, match=r"1 of 1 rows of .*agent.jsonl are longer than max_length of 4096 tokens"):
        encode_within_context(objective, rows, section, max_length=4096)
    assert renders[0] <= 2  # the first turn's prompt and the measurement; assembling rendered 1,600 times
    renders[0] = 0
    ids, _ = objective.encode({"messages": _long_conversation(3), "tools": TOOLS}, max_tokens=4096)
    assert renders[0] == 2 + 2 * 3 and len(ids) < 4096  # one that fits is assembled as before
