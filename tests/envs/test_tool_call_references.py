"""Differential tests against independent references: Meta's (``llama-models``: the Llama 3
tokenizer, the ``chat_format`` encoder that writes an assistant's tool call and the decoder that
reads one) for Llama 3.1 JSON calls and Llama 3.2 pythonic calls, and DeepSeek V3's published
chat template (``npm_artifacts.py``). Calls written by the reference are read back by posttrain
through the episode's path; calls posttrain writes are read back by the reference.

Deliberate disagreements (docs/training.md): Meta's decoder reads one call a turn (its
``FIXME: Enable multiple tool calls``), so several calls are compared with its list parser
(``parse_python_list_for_function_calls``); Meta's pythonic encoder writes a dict argument as
``{k=v}`` and strings unescaped, neither a Python literal its own decoder can read back, so its
turns are generated with arguments it writes correctly (posttrain writes Python literals, as
vLLM's ``pythonic`` parser reads them)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.envs.episode import Episode, EpisodeLimits
from posttrain.envs.tool_families import DeepSeekV3
from posttrain.envs.tool_formats import ToolCall, parse_turn, resolve_format
from posttrain.envs.turn_text import decode_turn, kept_markers
from tests.envs.npm_artifacts import npm_tokenizer
from tests.envs.real_artifacts import llama3_tokenizer

EXAMPLES = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
KEY = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
# what Meta's pythonic encoder writes as Python: no quote, backslash or line break in a string
PLAIN = st.text(st.characters(exclude_categories=("Cs", "Cc", "Zl", "Zp"), exclude_characters='"\\'), max_size=12)
SCALAR = st.none() | st.booleans() | st.integers(-(10**9), 10**9) | PLAIN
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["<|python_tag|>", "<|eot_id|>"]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


def episode_reads(tokenizer, family: str, ids: list[int]):
    tool_format = resolve_format(family)
    episode = Episode.start(tokenizer, QUESTION, EpisodeLimits(max_new_tokens=4096), markers=tool_format.markers)
    return parse_turn(tool_format, episode.add_turn(ids))


def meta_turn(call: ToolCall, prompt_format: str) -> list[int]:
    """The tokens Meta's encoder writes for an assistant message making ``call`` (after its header)."""
    from llama_models.datatypes import RawMessage, StopReason, ToolPromptFormat
    from llama_models.datatypes import ToolCall as MetaCall
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    chat = ChatFormat(Tokenizer.get_instance())
    made = MetaCall(call_id="c1", tool_name=call.name, arguments=call.arguments)
    message = RawMessage(role="assistant", content="", stop_reason=StopReason.end_of_turn, tool_calls=[made])
    ids, _ = chat.encode_message(message, ToolPromptFormat(prompt_format))
    return ids[len(chat._encode_header("assistant")) :]


# Meta's ToolCall holds arguments two levels deep at most (its RecursiveType)
META_VALUE = st.none() | st.booleans() | st.integers(-(10**9), 10**9) | TEXT
META_ARGUMENTS = st.dictionaries(
    TEXT, META_VALUE | st.lists(META_VALUE, max_size=3) | st.dictionaries(TEXT, META_VALUE, max_size=3), max_size=4
)


@EXAMPLES
@given(name=NAME, arguments=META_ARGUMENTS)
def test_llama3_json_calls_meta_writes_are_read_and_meta_reads_ours(name, arguments):
    from llama_models.datatypes import StopReason
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    call = ToolCall(name, arguments)
    turn = episode_reads(llama3_tokenizer(), "llama3_json", meta_turn(call, "json"))
    assert turn.status == "parsed" and turn.calls == [call], turn
    ours = resolve_format("llama3_json").render([call])
    decoded = ChatFormat(Tokenizer.get_instance()).decode_assistant_message_from_content(ours, StopReason.end_of_turn)
    assert [(c.tool_name, c.arguments) for c in decoded.tool_calls] == [(name, arguments)]


@EXAMPLES
@given(name=NAME, arguments=st.dictionaries(KEY, SCALAR | st.lists(SCALAR, max_size=3), max_size=4))
def test_pythonic_calls_meta_writes_are_read(name, arguments):
    call = ToolCall(name, arguments)
    turn = episode_reads(llama3_tokenizer(), "pythonic", meta_turn(call, "python_list"))
    assert turn.status == "parsed" and turn.calls == [call], turn


@EXAMPLES
@given(
    calls=st.lists(
        st.builds(
            ToolCall,
            NAME,
            st.dictionaries(
                KEY,
                st.recursive(
                    SCALAR | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
                    max_leaves=6,
                ),
                max_size=4,
            ),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_pythonic_calls_we_write_are_read_by_metas_list_parser(calls):
    from llama_models.llama3.tool_utils import parse_python_list_for_function_calls

    ours = resolve_format("pythonic").render(calls)
    assert parse_python_list_for_function_calls(ours) == [(c.name, c.arguments) for c in calls]
    # written as text: a special token's name inside a string is its characters, not the token
    text_ids = llama3_tokenizer()(ours, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    turn = episode_reads(llama3_tokenizer(), "pythonic", [*text_ids, llama3_tokenizer().eos_token_id])
    assert turn.calls == calls


def deepseek_turn(calls: list[ToolCall]) -> list[int]:
    """The tokens DeepSeek V3's published template writes for an assistant turn making ``calls``
    (rendered by transformers' compiled template: through ``apply_chat_template`` a message whose
    content is None loses the key, and the template's call branch needs it), up to its first EOS.
    The template closes the calls with ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`` after the second
    call and after each one past it, and not at all after a single call: a model trained on it stops
    after two calls, and a single call is followed by the EOS the model samples."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tokenizer = npm_tokenizer("deepseek-v3")
    template = _compile_jinja_template(tokenizer.chat_template)
    made = [{"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    message = {"role": "assistant", "content": None, "tool_calls": made}
    tokens = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    prompt = template.render(messages=QUESTION, add_generation_prompt=True, **tokens)
    whole = template.render(messages=[*QUESTION, message], add_generation_prompt=False, **tokens)
    assert whole.startswith(prompt)
    ids = [*tokenizer.encode(whole[len(prompt) :], add_special_tokens=False), tokenizer.eos_token_id]
    return ids[: ids.index(tokenizer.eos_token_id) + 1]  # sampling stops at the first EOS


@EXAMPLES
@given(calls=st.lists(st.builds(ToolCall, NAME, st.dictionaries(TEXT, JSON, max_size=4)), min_size=1, max_size=3))
def test_deepseek_v3_calls_its_template_writes_round_trip(calls):
    tokenizer = npm_tokenizer("deepseek-v3")
    ids = deepseek_turn(calls)
    turn = episode_reads(tokenizer, "deepseek_v3", ids)
    calls = calls[:2]  # what the template lets a turn hold (above)
    assert turn.status == "parsed" and turn.calls == calls, turn
    tool_format, markers = resolve_format("deepseek_v3"), kept_markers(tokenizer, DeepSeekV3.markers)
    for cut in range(1, len(ids) - 1):  # the turn as add_turn decodes it, cut where max_new_tokens would
        cut_turn = parse_turn(tool_format, decode_turn(tokenizer, ids[:cut], markers))
        assert cut_turn.status == "malformed" or cut_turn.calls == calls[: len(cut_turn.calls)], (cut, cut_turn)
