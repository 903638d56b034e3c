"""Tool calls in each family's format: what a model writes parses back to the calls it meant —
one call, parallel calls, nested JSON arguments — and what cannot be read says so (a call cut by
``max_new_tokens``, malformed JSON) instead of passing for a final answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.envs.tool_formats import TOOL_FORMATS, ToolCall, ToolFormatError, detect_format, resolve_format

FORMATS = sorted(TOOL_FORMATS)
ONE = [ToolCall("add", {"a": 2, "b": 3})]
PARALLEL = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("mul", {"a": 4, "b": 5})]
NESTED = [ToolCall("search", {"query": 'a "quoted" word', "filters": {"years": [2020, 2024], "lang": None}})]


def test_every_format_is_registered():
    assert set(FORMATS) == {"hermes", "smollm2", "llama3_json", "pythonic", "mistral", "deepseek_v3"}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("calls", [ONE, PARALLEL, NESTED], ids=["one", "parallel", "nested"])
def test_a_rendered_turn_parses_back_to_its_calls_in_order(name, calls):
    tool_format = resolve_format(name)
    turn = tool_format.parse(tool_format.render(calls))
    assert turn.status == "parsed" and turn.error is None
    assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name", FORMATS)
def test_a_call_cut_by_the_token_budget_is_malformed_not_an_answer(name):
    tool_format = resolve_format(name)
    text = tool_format.render(PARALLEL)
    for cut in (len(text) // 3, len(text) - 3):
        turn = tool_format.parse(text[:cut])
        assert turn.status == "malformed" and turn.error, (name, text[:cut])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2,, "b": 3}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>'),  # no name
        ("hermes", '<tool_call>\n{"name": "add", "arguments": [2, 3]}\n</tool_call>'),  # not an object
        ("llama3_json", '{"name": "add", "parameters": {"a": 2,, "b": 3}}'),
        ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2,, "b": 3}}]'),
        ("mistral", "[TOOL_CALLS]add[ARGS]{'a': 2}"),  # Python, not JSON
    ],
)
def test_malformed_calls_say_why(name, text):
    turn = resolve_format(name).parse(text)
    assert turn.status == "malformed" and turn.calls == [] and turn.error


@pytest.mark.parametrize("name", FORMATS)
def test_a_turn_without_a_call_is_the_final_answer(name):
    turn = resolve_format(name).parse("The sum is 5.")
    assert turn.status == "no_call" and turn.content == "The sum is 5."


def test_text_around_hermes_calls_is_kept_and_arguments_written_as_a_string_are_read():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    turn = resolve_format("hermes").parse(text)
    assert turn.content == "Let me add." and turn.calls == [ToolCall("add", {"a": 1, "b": 2})]


def test_llama3_calls_may_follow_the_python_tag_and_mistral_keeps_its_ids_and_newer_syntax():
    assert resolve_format("llama3_json").parse('<|python_tag|>{"name": "add", "parameters": {"a": 1}}').calls == [
        ToolCall("add", {"a": 1})
    ]
    turn = resolve_format("mistral").parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "a1B2c3D4e"}]')
    assert turn.calls == [ToolCall("add", {"a": 1}, "a1B2c3D4e")]
    newer = resolve_format("mistral").parse('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul[ARGS]{"b": {"c": 2}}')
    assert newer.calls == [ToolCall("add", {"a": 1}), ToolCall("mul", {"b": {"c": 2}})]


def test_auto_reads_the_format_from_the_chat_template_and_refuses_a_template_without_markers():
    assert detect_format("...{{- '<tool_call>\\n' }}...") == "hermes"
    assert detect_format("...[TOOL_CALLS]...") == "mistral"
    assert detect_format("...<|python_tag|>...") == "llama3_json"
    with pytest.raises(ToolFormatError, match="name the format"):
        resolve_format("auto", "{% for message in messages %}{{ message['content'] }}{% endfor %}")
    with pytest.raises(ToolFormatError, match="hermes"):
        resolve_format("json_maybe")


RESPONSE_TEMPLATE = Path(__file__).parent / "templates" / "hermes_response.json"


def test_a_response_template_is_read_by_transformers_parser_as_the_format_it_describes():
    hermes, by_template = resolve_format("hermes"), resolve_format(str(RESPONSE_TEMPLATE))
    for calls in (ONE, PARALLEL, NESTED):
        assert by_template.parse(hermes.render(calls)).calls == calls
    assert by_template.parse("The sum is 5.").status == "no_call"
    cut = by_template.parse(hermes.render(ONE)[:30])
    assert cut.status == "malformed" and "JSON" in cut.error
    # auto prefers a response template the tokenizer ships over the markers of its chat template
    shipped = resolve_format("auto", "...[TOOL_CALLS]...", json.loads(RESPONSE_TEMPLATE.read_text()))
    assert shipped.parse(hermes.render(PARALLEL)).calls == PARALLEL


def test_a_response_template_file_that_is_missing_or_wrong_is_one_message(tmp_path):
    with pytest.raises(ToolFormatError, match="does not exist"):
        resolve_format(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text('{"version": 1, "fields": {}}')
    with pytest.raises(ToolFormatError, match="not a valid response template"):
        resolve_format(str(tmp_path / "bad.json"))
