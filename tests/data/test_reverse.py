import pytest

from posttrain.data import DataError
from posttrain.data.tasks.reverse import (
    MANUAL_NAMES,
    make_names,
    make_prompt,
    make_rows,
    reverse_reward,
    split_names,
)


def test_names_are_deterministic_by_seed_and_well_formed():
    a, b, c = make_names(300, seed=1), make_names(300, seed=1), make_names(300, seed=2)
    assert a == b and a != c
    assert len(set(a)) == 300
    assert all(3 <= len(name) <= 8 and name.isalpha() and name.islower() for name in a)
    assert {len(name) for name in a} == set(range(3, 9))


def test_names_alternate_vowels_and_consonants():
    # Clusters have at most two letters and alternate, so no three vowels or consonants in a row.
    vowels = set("aeiou")
    for name in make_names(500, seed=0):
        runs = "".join("v" if ch in vowels else "c" for ch in name)
        assert "vvv" not in runs and "ccc" not in runs, name


def test_excluded_names_are_skipped():
    first = make_names(5, seed=0)
    assert not set(make_names(50, seed=0, exclude=first[:3])) & set(first[:3])
    assert make_names(3, seed=0, exclude=first[:1]) == first[1:4]


def test_splits_are_disjoint_and_hold_out_the_manual_names():
    train, held_out = split_names(2000, 100, seed=0)
    assert len(train) == 2000 and len(held_out) == 100
    assert held_out[: len(MANUAL_NAMES)] == list(MANUAL_NAMES)
    assert not set(train) & set(held_out)
    assert not set(train) & set(MANUAL_NAMES)
    assert len(set(train)) == 2000 and len(set(held_out)) == 100


def test_held_out_set_does_not_depend_on_train_size():
    assert split_names(10, 50, seed=3)[1] == split_names(5000, 50, seed=3)[1]
    assert split_names(10, 50, seed=3)[1] != split_names(10, 50, seed=4)[1]


def test_held_out_must_fit_the_manual_names():
    with pytest.raises(DataError, match="holds out at least 9 rows"):
        split_names(10, 5, seed=0)


def test_rows_follow_the_prompt_template():
    assert make_rows(["sean"]) == [
        {"prompt": "Reverse the name: sean. Answer:", "completion": " naes.", "name": "sean"}
    ]


@pytest.mark.parametrize(
    "completion, reward",
    [
        (" naes.", 1.0),
        (" naes.xyz. junk", 1.0),  # only the text up to the first "." counts
        ("  naes  .", 1.0),  # stripped
        (" Answer: naes.", 1.0),  # text after the last "Answer:"
        (" naes", 1.0),  # no "." at all: read to the end, as the lecture's parser does
        (" naez.", 0.0),
        (" sean.", 0.0),
        (" nae s.", 0.0),
        (" Naes.", 0.0),
        ("", 0.0),
        (".naes.", 0.0),
        (" naesx", 0.0),
    ],
)
def test_reward_on_correct_incorrect_and_malformed_outputs(completion, reward):
    assert reverse_reward([make_prompt("sean")], [completion]) == [reward]


def test_reward_batch_with_ids_extra_columns_and_other_prompts():
    prompts = [make_prompt("dareen"), make_prompt("manan"), "What is 2+2?"]
    completions = [" neerad.", " nana.", " 4."]
    rewards = reverse_reward(prompts, completions, [[1], [2], [3]], name=["dareen", "manan", "x"])
    assert rewards == [1.0, 0.0, None]  # None: not a reverse prompt, the reward does not apply


def test_reward_reads_conversational_messages():
    prompt = [{"role": "user", "content": make_prompt("joel")}]
    assert reverse_reward([prompt], [[{"role": "assistant", "content": " leoj."}]]) == [1.0]
    assert reverse_reward([prompt], [[{"role": "assistant", "content": " joel."}]]) == [0.0]


def test_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        reverse_reward([make_prompt("sean")] * 2, [" naes."])
