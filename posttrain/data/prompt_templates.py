"""Prompt templates (``data.prompt_template``): fixed text around every prompt of a dataset.

The template is applied when rows are loaded, so SFT, RL and the evaluations of both see the
same prompt text, and reward functions receive it too (the ``format`` reward reads whether a
prompt already opens ``<think>``). This is verl's way (the instruction is part of the prompt
column) rather than a chat template's: it is plain text, for base models as in R1-Zero.
Conversations are templated in their last user message, and their chat template applies after.
``data.chat_template`` turns text prompts into one user message each, for instruct models whose
chat template frames the turn (``chat_rows``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PLACEHOLDER = "{prompt}"

# DeepSeek-AI, "DeepSeek-R1" (2025), Table 1, as the lecture (seed 000, example 2) quotes it.
R1_ZERO = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User "
    "with the answer. The reasoning process and answer are enclosed within <think>...</think> and "
    "<answer>...</answer> tags, respectively, that is, <think> reasoning process here </think>"
    "<answer> answer here </answer>. User: {prompt}. Assistant:"
)
NAMED_TEMPLATES = {"r1_zero": R1_ZERO}


def resolve_prompt_template(value: str) -> str:
    """The template text a config value stands for: a name in ``NAMED_TEMPLATES`` or the text
    itself, which must contain ``{prompt}``."""
    text = NAMED_TEMPLATES.get(value, value)
    if PLACEHOLDER not in text:
        raise ValueError(
            f"prompt template {value!r} must contain {PLACEHOLDER} (where the prompt goes) or be one of: "
            f"{', '.join(sorted(NAMED_TEMPLATES))}"
        )
    return text


def apply_prompt_template(prompt: Any, template: str) -> Any:
    """``template`` with ``{prompt}`` replaced by `prompt` (other braces are kept as written);
    for a conversation, a copy whose last user message is templated."""
    if isinstance(prompt, str):
        return template.replace(PLACEHOLDER, prompt)
    messages = [dict(m) for m in prompt]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if users:
        messages[users[-1]]["content"] = template.replace(PLACEHOLDER, str(messages[users[-1]]["content"]))
    return messages


def template_rows(rows: Sequence[Mapping[str, Any]], template: str, column: str = "prompt") -> list[dict[str, Any]]:
    """Copies of `rows` with the prompt (`column`, or the ``messages`` of conversational rows)
    templated; rows are otherwise unchanged."""
    text = resolve_prompt_template(template)
    out = []
    for row in rows:
        row = dict(row)
        key = column if column in row else "messages" if "messages" in row else None
        if key is not None:
            row[key] = apply_prompt_template(row[key], text)
        out.append(row)
    return out


def chat_rows(rows: Sequence[Mapping[str, Any]], column: str = "prompt") -> list[dict[str, Any]]:
    """Copies of `rows` whose text prompt (`column`) became a one-message conversation,
    ``[{"role": "user", "content": prompt}]``, which the tokenizer's chat template formats
    (``data.chat_template``); prompts already given as messages are kept."""
    out = []
    for row in rows:
        row = dict(row)
        if isinstance(row.get(column), str):
            row[column] = [{"role": "user", "content": row[column]}]
        out.append(row)
    return out
