import pytest
from transformers import AutoTokenizer

from posttrain.models.tokenizers import DEFAULT_CHARSET, build_char_tokenizer

TEXTS = [
    "Reverse the name: sean. Answer: naes.",
    "  two  spaces , before . and after ",  # the clean-up pass would eat " ," and " ."
    "It's 42 - yes!? a:b",
    "x",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_per_character_and_exact_round_trip(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # also proves no BOS/EOS is added
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids) == list(text)


def test_special_tokens_have_fixed_ids_and_are_skipped(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert len(tokenizer) == 4 + len(DEFAULT_CHARSET)
    ids = [tokenizer.bos_token_id, *tokenizer(" naes.")["input_ids"], tokenizer.eos_token_id, 0, 0]
    assert tokenizer.decode(ids, skip_special_tokens=True) == " naes."
    assert tokenizer.decode(ids) == "<bos> naes.<eos><pad><pad>"


def test_unknown_character_maps_to_unk(tokenizer):
    assert tokenizer("aéb")["input_ids"] == [
        tokenizer.convert_tokens_to_ids("a"),
        tokenizer.unk_token_id,
        tokenizer.convert_tokens_to_ids("b"),
    ]


def test_save_and_load_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.pad_token_id == 0 and loaded.eos_token_id == 2 and loaded.bos_token_id == 1
    assert len(loaded) == len(tokenizer)


def test_custom_charset_is_deduplicated_in_order():
    tokenizer = build_char_tokenizer("abca")
    assert len(tokenizer) == 4 + 3
    assert tokenizer("cab")["input_ids"] == [6, 4, 5]
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")
