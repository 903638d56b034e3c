"""A recorded conversation as one SFT example: every assistant turn trained (its text and the stop
token), everything else context, assembled as RL assembles an episode (``episode.py``), so a cold
start on recorded tool use teaches the tokens RL then samples, in the context RL shows. Its tool
calls, given as text or as OpenAI's and TRL's ``tool_calls``, are written in the model's own format."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.envs.episode import Episode, EpisodeLimits
from posttrain.envs.tool_formats import ToolCall, tokenizer_format
from posttrain.envs.turn_text import encode_turn, kept_markers
from posttrain.models.chat import chat_prompt_ids


def conversation_example(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    max_tokens: int | None = None,
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a whole conversation for SFT, every assistant turn trained (its
    text and the stop token, mask 1) and every other token context (mask 0): TRL's
    ``assistant_only_loss``, built by the episode assembly RL uses, so a cold start on recorded
    episodes (tool calls and their results included) teaches the tokens RL then samples, in the
    context RL shows — and a template that rewrites history is refused naming the turn.
    ``tools``: the schemas the template lists, as the ``tools`` environment gives them.

    Assembling renders the conversation up to each turn, so its cost grows with the square of
    its turns (800 short turns: a minute). With ``max_tokens`` the row is measured first by one
    rendering — the last turn's prompt, its text and the stop token; the assembled sequence is
    that plus any stop token the template does not write after an earlier turn — and one longer
    is returned as measured, nothing trained, unassembled: the caller refuses or skips the row by
    its length (``data/lengths.py``)."""
    roles = [message.get("role") for message in messages]
    if "assistant" not in roles:
        raise ValueError("a conversation for SFT needs at least one assistant message")
    first = roles.index("assistant")
    if first == 0:
        raise ValueError("a conversation for SFT starts with a user (or system) message, not the assistant's")
    turns = roles.count("assistant")
    limits = EpisodeLimits(max_new_tokens=1 << 30, max_turns=turns)
    episode = Episode.start(tokenizer, [dict(m) for m in messages[:first]], limits, tools=tools)
    stop = sorted(episode.stop_token_ids)[:1]
    writer = _call_writer(tokenizer) if any(m.get("tool_calls") for m in messages) else None
    markers = kept_markers(tokenizer, writer.markers if writer is not None else ())
    texts = {index: assistant_text(messages[index], writer) for index, role in enumerate(roles) if role == "assistant"}
    if max_tokens is not None:
        last = max(texts)  # the sequence is the prompt of the last turn, its text and the stop token
        before = [{"role": "assistant", "content": texts[i]} if i in texts else dict(m) for i, m in enumerate(messages)]
        prompt = chat_prompt_ids(tokenizer, before[:last], tools=tools)
        measured = [*prompt, *encode_turn(tokenizer, texts[last], markers), *stop]
        if len(measured) > max_tokens:
            return measured, [0] * len(measured)
    index = first
    while index < len(messages):
        episode.add_turn([*encode_turn(tokenizer, texts[index], markers), *stop])
        following = index + 1
        while following < len(messages) and roles[following] != "assistant":
            following += 1
        observation = [dict(m) for m in messages[index + 1 : following]]
        if episode.finished:  # the last assistant turn: max_turns reached
            break
        episode.add_result(observation or None, None, done=not observation)
        index = following
    return list(episode.ids), list(episode.mask)


def assistant_text(message: Mapping[str, Any], writer: Any = None) -> str:
    """What the model writes for an assistant message: its content, then its ``tool_calls``
    (OpenAI's and TRL's form, arguments as an object or a JSON string) written by ``writer``, the
    tool-call format of the model's family (``tool_formats.py``), as the tools environment reads
    them back. A dataset's call turn with empty content trained only the stop token: the model
    learned to stop where it should call."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if not calls:
        return content
    parsed = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments") or {}
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        call_id = call.get("id")  # Mistral writes it in the call; other families leave it out
        parsed.append(ToolCall(function["name"], arguments, call_id if isinstance(call_id, str) else None))
    return writer.render(parsed, content)


def _call_writer(tokenizer: Any) -> Any:
    """The tool-call format the tokenizer's chat template is written for (or its response template)."""
    return tokenizer_format("auto", tokenizer)
