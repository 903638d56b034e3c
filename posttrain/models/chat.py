"""Chat templates: format conversations the way the model was (or will be) trained to read them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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


def ensure_chat_template(tokenizer: Any) -> Any:
    """Give a tokenizer without a chat template posttrain's default one; keep an existing one."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def chat_prompt_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation, by default up to and including the opening of the
    assistant's turn (what a sampler continues from). No BOS/EOS beyond what the template writes."""
    ensure_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def prompt_ids(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids a sampler continues from: plain text as is (no special tokens added), a
    conversation through the chat template with the assistant's turn opened."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return chat_prompt_ids(tokenizer, prompt)


def split_conversation(messages: Sequence[Mapping[str, str]]) -> tuple[list[Mapping[str, str]], str]:
    """(messages before the last assistant turn, that turn's text) for SFT on conversations."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a conversation for SFT must end with an assistant message")
    return list(messages[:-1]), messages[-1]["content"]
