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


def test_bpe_tokenizer_trained_here_round_trips(tmp_path):
    from transformers import AutoTokenizer

    from posttrain.data.tasks.reverse import make_prompt, split_names
    from posttrain.models.tokenizers import train_bpe_tokenizer

    names, _ = split_names(300, 9, seed=0)
    tokenizer = train_bpe_tokenizer([make_prompt(n) + f" {n[::-1]}." for n in names], vocab_size=300)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
    text = "Reverse the name: sean. Answer: naes.\nÜnïcödé 3+5=8"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text)  # merges learned: fewer tokens than characters
    assert tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).decode(ids) == text


def test_default_chat_template_works_for_char_and_bpe_tokenizers():
    from posttrain.models.chat import chat_prompt_ids, ensure_chat_template, split_conversation

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse sean."}]
    tokenizer = ensure_chat_template(build_char_tokenizer())
    text = tokenizer.decode(chat_prompt_ids(tokenizer, messages))
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nReverse sean.<|end|>\n<|assistant|>\n"
    assert tokenizer.unk_token_id not in chat_prompt_ids(tokenizer, messages)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"  # an existing template is kept
    assert ensure_chat_template(tokenizer).chat_template == "{{ messages[0]['content'] }}"
    history, answer = split_conversation([*messages, {"role": "assistant", "content": "naes"}])
    assert history == messages and answer == "naes"


def test_charset_covers_tags_arithmetic_and_chat_markers():
    for char in "<>/=+*()|_\n":
        assert char in DEFAULT_CHARSET, repr(char)


def test_bpe_chat_markers_are_single_special_tokens_and_the_template_survives_saving(tmp_path):
    from transformers import AutoTokenizer

    from posttrain.models.chat import CHAT_MARKERS, chat_prompt_ids, ensure_chat_template
    from posttrain.models.tokenizers import train_bpe_tokenizer

    tokenizer = ensure_chat_template(train_bpe_tokenizer(TEXTS * 20, vocab_size=300))
    assert tokenizer.convert_ids_to_tokens([4, 5, 6, 7]) == list(CHAT_MARKERS)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Reverse sean."}, {"role": "assistant", "content": "naes"}]
    for tok in (tokenizer, loaded):
        prompt = chat_prompt_ids(tok, messages[:1])
        assert prompt[0] == tok.convert_tokens_to_ids("<|user|>") and prompt[-2:] == tok("<|assistant|>\n")["input_ids"]
        whole = chat_prompt_ids(tok, messages, add_generation_prompt=False)
        assert tok.decode(whole) == "<|user|>\nReverse sean.<|end|>\n<|assistant|>\nnaes<|end|>\n"
        assert set(CHAT_MARKERS) <= set(tok.all_special_tokens)
        assert tok.decode(whole, skip_special_tokens=True) == "\nReverse sean.\n\nnaes\n"
