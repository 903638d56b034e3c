"""Tool-call turns as the families' published formats write them, each class that was read wrongly
(issue: tool calls on real artifacts). Sources: mistral-common's instruct encoders
(``InstructTokenizerV3`` to ``V13``), Meta's Llama 3.1 prompt format, SmolLM2's tool prompt. A cut
or broken call is malformed, never a final answer and never a call turn with zero calls; nothing a
model wrote is dropped in silence."""

from __future__ import annotations

import pytest

from posttrain.envs.tool_formats import ToolCall, parse_turn, resolve_format

ADD = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
MUL = '{"name": "mul", "arguments": {"a": 4, "b": 5}}'


def parse(name: str, text: str):
    return parse_turn(resolve_format(name), text)


def test_a_mistral_v11_call_with_an_id_keeps_the_name_and_the_id_apart():
    turn = parse("mistral", '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 2, "b": 3}')
    assert turn.status == "parsed" and turn.calls == [ToolCall("add", {"a": 2, "b": 3}, "a1b2c3d4e")]
    two = parse("mistral", '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 2}[TOOL_CALLS]mul[CALL_ID]f6g7h8i9j[ARGS]{}')
    assert two.calls == [ToolCall("add", {"a": 2}, "a1b2c3d4e"), ToolCall("mul", {}, "f6g7h8i9j")]


def test_a_second_mistral_list_is_read_and_a_cut_one_is_malformed():
    turn = parse("mistral", f"[TOOL_CALLS][{ADD}][TOOL_CALLS][{MUL}]")
    assert turn.status == "parsed" and [c.name for c in turn.calls] == ["add", "mul"]
    for cut in (
        f"[TOOL_CALLS][{ADD}][TOOL_CALLS]",
        f"[TOOL_CALLS][{ADD}][TOOL_CALLS] ",
        "[TOOL_CALLS]add[ARGS]{}[TOOL_CALLS]",
    ):
        turn = parse("mistral", cut)
        assert turn.status == "malformed" and "cut" in turn.error, cut


def test_mistral_v11_arguments_may_quote_the_marker():
    text = '[TOOL_CALLS]echo[ARGS]{"text": "write [TOOL_CALLS] then [ARGS]"}'
    assert parse("mistral", text).calls == [ToolCall("echo", {"text": "write [TOOL_CALLS] then [ARGS]"})]


@pytest.mark.parametrize(
    "text",
    [f"[TOOL_CALLS][{ADD}] and then I will answer", f"[TOOL_CALLS][{ADD}]]", '[TOOL_CALLS]add[ARGS]{"a": 2}}'],
    ids=["text", "a stray bracket after a list", "a stray brace after a call"],
)
def test_text_after_the_last_mistral_call_is_malformed_not_dropped(text):
    turn = parse("mistral", text)
    assert turn.status == "malformed" and "after the last call" in turn.error


@pytest.mark.parametrize(
    ("name", "text"),
    [("mistral", "[TOOL_CALLS]"), ("mistral", "Let me add. [TOOL_CALLS]\n"), ("llama3_json", "<|python_tag|>")],
)
def test_a_turn_ending_at_the_call_marker_is_a_cut_call(name, text):
    turn = parse(name, text)
    assert turn.status == "malformed" and turn.calls == [] and turn.error


def test_text_after_the_python_tag_that_is_not_a_call_is_malformed():
    turn = parse("llama3_json", "<|python_tag|>brave_search.call(query='x')")
    assert turn.status == "malformed" and "not a JSON call" in turn.error


def test_smollm2s_empty_list_says_no_call_is_needed():
    turn = parse("smollm2", "<tool_call>[]</tool_call>")
    assert turn.status == "no_call" and turn.calls == []
    answer = parse("smollm2", "The sum is 5.\n<tool_call>[]</tool_call>")
    assert answer.status == "no_call" and answer.content == "The sum is 5."


def test_llama_parallel_calls_may_be_separated_by_crlf():
    turn = parse("llama3_json", '{"name": "add", "parameters": {"a": 1}};\r\n{"name": "mul", "parameters": {"b": 2}}')
    assert turn.status == "parsed" and [c.name for c in turn.calls] == ["add", "mul"]
    turn = parse("llama3_json", '{"name": "add", "parameters": {"a": 1}}\r\n{"name": "mul", "parameters": {"b": 2}}')
    assert turn.status == "parsed" and [c.name for c in turn.calls] == ["add", "mul"]


class NoCalls:
    markers = ()

    def parse(self, text):
        from posttrain.envs.tool_formats import ParsedTurn

        return ParsedTurn("parsed", [], text)


def test_a_format_that_reads_a_call_turn_without_calls_gives_a_malformed_turn():
    turn = parse_turn(NoCalls(), "<call></call>")
    assert turn.status == "malformed" and "without a call" in turn.error


def test_mistral_tool_results_carry_the_calls_id_or_a_nine_character_one():
    from tests.envs.test_tools_env import step, tools_env

    env = tools_env("add", format="mistral")
    env.reset({"prompt": "go"})
    replies, _, _ = step(
        env, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, ' + ADD[:-1] + ', "id": "a1b2c3d4e"}]'
    )
    assert [reply["content"] for reply in replies] == ["3", "5"]
    assert replies[1]["tool_call_id"] == "a1b2c3d4e"  # the model's own
    made = replies[0]["tool_call_id"]
    assert len(made) == 9 and made.isalnum()  # what Mistral's templates require of every tool result
    replies, _, _ = step(env, "[TOOL_CALLS]")  # the answer to an unreadable turn is a tool message too
    assert len(replies[0]["tool_call_id"]) == 9 and replies[0]["tool_call_id"] != made
    hermes = tools_env("add")  # a family whose template needs no id gets none
    hermes.reset({"prompt": "go"})
    assert (
        "tool_call_id"
        not in step(hermes, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')[0][0]
    )
