"""Tool calls sampled as the families' real tokenizers write them reach the environment as calls
(``real_artifacts.py``: the published files, pinned). With Mistral's tokenizers every
``[TOOL_CALLS]`` call read as a final answer: the marker is a control token, and turns were decoded
with special tokens skipped before the parser saw them."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.envs import resolve_environment
from posttrain.envs.episode import Episode, EpisodeLimits
from tests.envs.real_artifacts import MISTRAL, mistral_tokenizer

HERE = "tests.envs.test_tool_calls_real_tokenizers"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def sampled_call(tokenizer, tools, call_id: str = "a1b2c3d4e") -> list[int]:
    """The tokens of an assistant turn calling add(2, 3) as mistral-common's encoder writes them
    (the turn between the prompt and the tool result, its EOS included)."""
    call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    result = {"role": "tool", "content": "5", "tool_call_id": call_id, "name": "add"}
    conversation = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}, result]
    prompt = list(tokenizer.apply_chat_template(QUESTION, tools=tools, tokenize=True, return_dict=False))
    whole = list(tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False))
    assert whole[: len(prompt)] == prompt
    turn = whole[len(prompt) :]
    return turn[: turn.index(tokenizer.eos_token_id) + 1]


@pytest.mark.parametrize("name", MISTRAL)
def test_a_mistral_call_as_its_tokenizer_writes_it_is_a_call_for_the_environment(name):
    tokenizer = mistral_tokenizer(name)
    env = resolve_environment("tools", {"tools": [f"{HERE}:add"]})()  # format: auto
    env.use_tokenizer(tokenizer)
    assert type(env.format).__name__ == "Mistral"  # read from the vocabulary: it has no Jinja template
    episode = Episode.start(
        tokenizer, QUESTION, EpisodeLimits(max_new_tokens=256, max_turns=2),
        tools=env.chat_tools, markers=env.turn_markers,
    )  # fmt: skip
    ids = sampled_call(tokenizer, env.chat_tools)
    assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    text = episode.add_turn(ids)
    assert text.startswith("[TOOL_CALLS]") and "\u2581" not in text  # SentencePiece's space stays a space
    replies, _, done = asyncio.run(env.step(text))
    assert not done and [reply["content"] for reply in replies] == ["5"]
    assert env.turns[0].calls[0].id == "a1b2c3d4e"


@pytest.mark.parametrize("name", MISTRAL)
def test_a_whole_mistral_episode_plays_as_its_encoder_writes_the_conversation(name):
    """mistral-common's encoder cannot render a conversation ending in the assistant's turn, and
    writes a call held as text otherwise than sampled: the tool result is appended as its delta
    after the turn's </s> (``rewritten_turns``), token for token what the encoder writes there."""
    tokenizer = mistral_tokenizer(name)
    env = resolve_environment("tools", {"tools": [f"{HERE}:add"]})()
    env.use_tokenizer(tokenizer)
    limits = EpisodeLimits(max_new_tokens=256, max_turns=3)
    episode = Episode.start(tokenizer, QUESTION, limits, tools=env.chat_tools, markers=env.turn_markers)
    prompt = list(episode.ids)
    call = sampled_call(tokenizer, env.chat_tools)
    replies, reward, done = asyncio.run(env.step(episode.add_turn(call)))
    episode.add_result(replies, reward, done)
    reference = list(
        tokenizer.apply_chat_template(
            [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [_call()]}, _result()],
            tools=env.chat_tools, tokenize=True, return_dict=False,
        )
    )  # fmt: skip
    assert episode.ids == reference and episode.rewritten_turns == [1]
    answer = [*tokenizer.encode("It is 5.", add_special_tokens=False), tokenizer.eos_token_id]
    replies, reward, done = asyncio.run(env.step(episode.add_turn(answer)))
    assert done and episode.texts[-1] == "It is 5."
    episode.add_result(replies, reward, done)
    trained = [token for token, mask in zip(episode.ids, episode.mask, strict=True) if mask]
    assert trained == [*call, *answer] and episode.ids[: len(prompt)] == prompt


def _call():
    return {"id": "a1b2c3d4e", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def _result():
    return {"role": "tool", "content": "5", "tool_call_id": "a1b2c3d4e", "name": "add"}


@pytest.mark.parametrize("name", ["mistral-v3", "mistral-v7"])
def test_sft_on_a_recorded_mistral_call_trains_the_tokens_its_encoder_writes(name):
    """A recorded conversation in OpenAI's form: the call turn is trained as mistral-common's
    encoder writes it, ``[TOOL_CALLS]`` as its control token (mistral-common encodes the name as
    plain text, so it trained ``[``, ``TOOL``, ... before), the result and answer as context/trained."""
    from posttrain.envs.conversation import conversation_example

    tokenizer = mistral_tokenizer(name)
    tools = resolve_environment("tools", {"tools": [f"{HERE}:add"]})().chat_tools
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [_call()]}, _result()]
    conversation.append({"role": "assistant", "content": "It is 5."})
    ids, mask = conversation_example(tokenizer, conversation, tools=tools)
    call = sampled_call(tokenizer, tools)
    prompt = list(tokenizer.apply_chat_template(QUESTION, tools=tools, tokenize=True, return_dict=False))
    end = len(prompt) + len(call)
    assert ids[:end] == [*prompt, *call] and mask[len(prompt) : end] == [1] * len(call)
    reference = list(tokenizer.apply_chat_template(conversation[:3], tools=tools, tokenize=True, return_dict=False))
    assert ids[: len(reference)] == reference  # the tool result as the encoder writes it
    answer = [*tokenizer.encode("It is 5.", add_special_tokens=False), tokenizer.eos_token_id]
    assert ids[-len(answer) :] == answer and mask[-len(answer) :] == [1] * len(answer)
