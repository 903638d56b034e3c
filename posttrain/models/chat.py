"""Chat templates: format conversations the way the model was (or will be) trained to read them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.errors import PosttrainError

# A ChatML-like template with short markers (they must be encodable by the character
# tokenizer, whose charset includes < > | and newline). `add_generation_prompt` opens the
# assistant's turn so that generation continues as the assistant.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The markers the default template writes for the usual roles; BPE tokenizers trained here make
# each one a single special token.
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


class ChatTemplateError(PosttrainError, ValueError):
    """A conversation the tokenizer's chat template cannot write the way training needs it.
    Callers that know the row wrap it in a ``DataError`` naming the file and row."""


def ensure_chat_template(tokenizer: Any) -> Any:
    """Give a tokenizer without a chat template posttrain's default one; keep an existing one, and
    leave one that renders chats without a template alone (mistral-common's, :func:`renders_itself`)."""
    if not getattr(tokenizer, "chat_template", None) and not renders_itself(tokenizer):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def _refusals(tokenizer: Any) -> tuple[type[BaseException], ...]:
    """What the tokenizer's chat rendering raises for a conversation it will not write: a Jinja
    template's ``raise_exception``, mistral-common's validators."""
    from jinja2.exceptions import TemplateError

    if not renders_itself(tokenizer):
        return (TemplateError,)
    from mistral_common.exceptions import MistralCommonException

    return TemplateError, MistralCommonException


def renders_itself(tokenizer: Any) -> bool:
    """A tokenizer whose ``apply_chat_template`` is a reference encoder, not a Jinja template:
    transformers' ``MistralCommonBackend`` (mistral-common), a Mistral model's tokenizer."""
    return type(tokenizer).__name__ == "MistralCommonBackend"


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation, by default up to and including the opening of the
    assistant's turn (what a sampler continues from). No BOS/EOS beyond what the template writes.
    ``tools``: JSON schemas of the functions the model may call, written where its template puts them."""
    ensure_chat_template(tokenizer)
    try:
        extra = {"tools": list(tools)} if tools else {}
        if renders_itself(tokenizer):  # mistral-common: no generation prompt to add, and it may not be asked
            add_generation_prompt = False
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **extra
        )
    except _refusals(tokenizer) as error:
        raise ChatTemplateError(f"the tokenizer's chat template refuses this conversation: {error}") from None
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def prompt_ids(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids a sampler continues from: plain text as is (no special tokens added), a
    conversation through the chat template with the assistant's turn opened."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return chat_prompt_ids(tokenizer, prompt)


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool) -> str:
    """The text the chat template writes for `messages`; a template that refuses them (e.g.
    "roles must alternate") raises :class:`ChatTemplateError` with its own words."""
    ensure_chat_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt and not renders_itself(tokenizer),
            tokenize=False,
        )
    except _refusals(tokenizer) as error:
        raise ChatTemplateError(f"the tokenizer's chat template refuses this conversation: {error}") from None


def reply_ids(
    tokenizer: Any, prompt: Sequence[Mapping[str, str]], response: Sequence[Mapping[str, str]]
) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a conversational reply for SFT, reward models and DPO.

    The prompt is encoded as a sampler continues from it (:func:`chat_prompt_ids`: the chat
    template with the assistant's turn opened) and the final assistant message as its text
    plus EOS: the tokens a rollout produces, so what offline training teaches or scores is
    what RL later generates. Messages of the response before its final one (a tool call and
    its result) are written by the template, as TRL does: the text the template adds after
    the prompt, tokenised on its own.

    As TRL checks (``maybe_apply_chat_template``), the rendered prompt must be a prefix of the
    rendered conversation: a template whose generation prompt differs from the way it writes
    an assistant's turn (or that rewrites earlier turns once a reply follows) would train a
    reply after text the template never shows the model; that is refused.
    """
    history = [*prompt, *response[:-1]]
    start = render_chat(tokenizer, prompt, add_generation_prompt=True)
    opened = render_chat(tokenizer, history, add_generation_prompt=True)
    whole = render_chat(tokenizer, [*prompt, *response], add_generation_prompt=False)
    for before, after in ((start, opened), (opened, whole)):
        if not after.startswith(before):
            same = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(after))
            raise ChatTemplateError(
                "the chat template writes the prompt differently once the reply follows: with the assistant's "
                f"turn opened it reads {before[same:][:40]!r} where the written conversation reads "
                f"{after[same:][:40]!r}; use a tokenizer whose generation prompt opens the assistant's turn as its "
                "written turns do, or give the rows as text"
            )
    middle = tokenizer(opened[len(start) :], add_special_tokens=False)["input_ids"] if len(response) > 1 else []
    reply = tokenizer(response[-1]["content"], add_special_tokens=False)["input_ids"]
    return chat_prompt_ids(tokenizer, prompt), [*middle, *reply, tokenizer.eos_token_id]


def split_conversation(messages: Sequence[Mapping[str, str]]) -> tuple[list[Mapping[str, str]], str]:
    """(messages before the last assistant turn, that turn's text) for SFT on conversations."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a conversation for SFT must end with an assistant message")
    return list(messages[:-1]), messages[-1]["content"]
