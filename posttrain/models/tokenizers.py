"""Tokenizers built locally with the `tokenizers` library: one token per character, or BPE.

Small tasks (reversing a name, adding digits) are easier to learn and to debug when every
character is one token: the model never has to spell inside a subword. The result is a plain
``transformers`` fast tokenizer, so ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
work and every other part of posttrain treats it like any Hub tokenizer. The byte-level BPE
tokenizer trained here stands in for a real subword tokenizer where one is needed offline.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.models.chat import CHAT_MARKERS

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Every character the built-in tasks write into a prompt or a completion.
# Letters, digits and punctuation of the built-in tasks, plus what the R1-Zero format and
# chat templates need: tags (<think>, </answer>), arithmetic (= + * /), brackets, newline.
DEFAULT_CHARSET = "".join(sorted(set(string.ascii_letters + string.digits + " .:,!?'-<>/=+*()|_\n")))


def build_char_tokenizer(charset: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character of `charset`; ids 0-3 are ``<pad> <bos> <eos> <unk>``.

    Characters outside `charset` encode to ``<unk>``. Encoding adds no special tokens (no
    BOS, no EOS): callers append EOS where a sequence should end, as SFT does.
    """
    chars = list(dict.fromkeys(DEFAULT_CHARSET if charset is None else charset))  # dedupe, keep order
    if not chars:
        raise ValueError("charset is empty: give at least one character")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    # BPE with an empty merge list and no pre-tokenizer splits text into single characters
    # and keeps spaces as ordinary tokens. Fuse() joins tokens back with no separator; the
    # default decoder would put a space between every pair ("a b c").
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        # transformers 4.x runs a clean-up pass by default that deletes the space before "."
        # and ","; 5.x skips it for BPE but warns. Off, so decoding returns the text exactly.
        clean_up_tokenization_spaces=False,
    )


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    *,
    min_frequency: int = 2,
    extra_special_tokens: Sequence[str] = CHAT_MARKERS,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on ``texts`` — a "real" subword tokenizer for
    tests and demos that must not depend on a downloaded one.

    Special tokens ``<pad> <bos> <eos> <unk>`` get ids 0–3, as in the character tokenizer, then
    ``extra_special_tokens`` (by default the markers of posttrain's chat template, so each is
    one token). Byte-level means any text encodes and decodes back exactly. Encoding adds no
    BOS/EOS, like the character tokenizer.
    """
    specials = list(dict.fromkeys([*SPECIAL_TOKENS, *extra_special_tokens]))
    if vocab_size < len(specials) + 256:
        raise ValueError(f"vocab_size={vocab_size} must be at least 256 bytes + {len(specials)} special tokens")
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        # registered as special, so decode(..., skip_special_tokens=True) drops them too
        additional_special_tokens=specials[len(SPECIAL_TOKENS) :],
        clean_up_tokenization_spaces=False,
    )
