"""Tokenizers and chat templates for the environment tests, built locally: a byte-level BPE
tokenizer whose end-of-sequence token is ChatML's ``<|im_end|>`` (as Qwen's is), a correct
ChatML template and two that rewrite history the way the issue trackers report."""

from __future__ import annotations

from posttrain.models.tokenizers import train_bpe_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's template drops the <think> block of assistant turns before the last user message
# (it keeps it in the turns after it): once the user answers, the thinking the policy sampled
# disappears from the rendered history.
QWEN3_LIKE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in m['content'] %}"
    "<|im_start|>assistant\n{{ m['content'].split('</think>')[-1].lstrip('\n') }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Writes the newline after <|im_end|> only after the last message: at every turn boundary the
# newline the previous rendering ended with is gone. (Written as an expression: transformers
# compiles templates with trim_blocks, which would drop a literal newline after the tag.)
DROPS_NEWLINE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
    "{% if loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "my laptop will not turn on. ask: battery? yes. fix: charge thanks, it works now!",
    "<think>the user says the wifi is down, so ask about the router</think>ask: router?",
    "what is 2*(3+4)? <calc>2*(3+4)</calc> <result>14</result> <answer>14</answer>",
    "<python>print(6 * 7)</python> <output>42</output> hello there, how are you?",
]


def chatml_tokenizer(template: str = CHATML):
    """A BPE tokenizer with ``<|im_start|>``/``<|im_end|>`` as single special tokens and
    ``<|im_end|>`` as its EOS, so a sampled turn ends with the template's end-of-turn token."""
    tokenizer = train_bpe_tokenizer(CORPUS * 8, vocab_size=320, extra_special_tokens=("<|im_start|>", "<|im_end|>"))
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
