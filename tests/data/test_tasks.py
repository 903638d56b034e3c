"""Built-in tasks: deterministic by seed, disjoint splits, correct answers, rule-consistent labels."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from posttrain.data import validate_rows
from posttrain.data.tasks import TASKS, get_task
from posttrain.data.tasks.arithmetic import max_problems, split_problems
from posttrain.data.tasks.preference import (
    KIND_WORDS,
    LABEL_NOISE,
    response_words,
    split_pairs,
    true_preference_score,
)
from posttrain.models.tokenizers import DEFAULT_CHARSET

FORMATS = {
    "reverse": "prompt_completion",
    "arithmetic": "prompt_completion",
    "preference": "preference",
    "preference_noisy": "preference",
    "preference_sft": "prompt_completion",
    "support_bot": "episode",
}


def row_key(row):
    return (row["prompt"], row.get("completion"), row.get("chosen"), row.get("rejected"))


# support_bot's rows are hidden issues of an environment (six of them): held-out episodes are new
# draws of the same users, so its rows cannot be disjoint; its own test is below
EPISODE_TASKS = {"support_bot"}


@pytest.mark.parametrize("name", sorted(set(TASKS) - EPISODE_TASKS))
def test_tasks_are_deterministic_by_seed_with_disjoint_splits(name):
    task = get_task(name)
    a, again, other = task(300, 60, 0), task(300, 60, 0), task(300, 60, 1)
    assert a == again
    assert a.train != other.train and a.held_out != other.held_out
    assert len(a.train) == 300 and len(a.held_out) == 60
    assert not {row_key(r) for r in a.train} & {row_key(r) for r in a.held_out}
    assert task(1000, 60, 0).held_out == a.held_out  # held-out rows do not depend on the train size


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_rows_are_valid_short_and_inside_the_char_tokenizers_charset(name):
    data = get_task(name)(500, 100, 0)
    for rows in (data.train, data.held_out):
        named = "episode" if name in EPISODE_TASKS else None  # never detected: a run with env names it
        assert validate_rows(rows, source=name, data_format=named).data_format == FORMATS[name]
    text = "".join(v for r in data.train + data.held_out for v in r.values() if isinstance(v, str))
    assert set(text) <= set(DEFAULT_CHARSET), set(text) - set(DEFAULT_CHARSET)
    longest = max(len(v) for r in data.train for v in r.values() if isinstance(v, str))
    assert longest <= 75, longest


def test_an_unknown_task_lists_the_valid_ones():
    valid = "arithmetic, preference, preference_noisy, preference_sft, reverse"
    with pytest.raises(KeyError, match=f"valid names: {valid}"):
        get_task("maths")


# --- arithmetic -------------------------------------------------------------------------------
# The test's own reading of a problem: the verb says the operation, the two numbers are the operands.
OPERATION_WORDS = {"buys": "+", "adds": "+", "gives away": "-", "takes": "-", "in each": "*", "boxes of": "*"}


def read_problem(prompt):
    ops = {op for word, op in OPERATION_WORDS.items() if word in prompt}
    assert len(ops) == 1, prompt
    a, b = (int(n) for n in re.findall(r"\d+", prompt))
    return a, ops.pop(), b


def test_arithmetic_answers_are_right():
    data = get_task("arithmetic")(1000, 200, 3)
    ops = Counter()
    for row in data.train + data.held_out:
        a, op, b = read_problem(row["prompt"])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        assert value >= 0 and row["answer"] == str(value), row
        assert row["completion"] == f"<think> {a} {op} {b} = {value} </think><answer> {value} </answer>"
        ops[op] += 1
    assert min(ops.values()) > 0.25 * len(data.train + data.held_out), ops  # templates drawn evenly
    assert len({r["prompt"] for r in data.train}) == 1000  # no prompt twice


def test_arithmetic_draws_many_distinct_problems_and_stops_with_a_clear_error():
    limit = max_problems()
    train, held_out = split_problems(limit - 500, 500, seed=0)  # quick even at the limit
    assert len({r["prompt"] for r in train + held_out}) == limit >= 10_000
    with pytest.raises(
        ValueError, match=rf"asked for {limit} \+ 1 problems; the arithmetic task draws at most {limit}"
    ):
        split_problems(limit, 1, seed=0)


# --- preference -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completion", "score"),
    [
        (" nice calm cat.", 3.0),  # 2 kind words + the animal
        (" good kind nice warm cat.", 4.0),  # kind words count at most 3
        (" nice calm dog.", 2.0),  # another animal earns nothing
        (" Nice, CALM cat!", 3.0),  # case and punctuation do not matter
        (" nice nice nice.", -1.0),  # 1 kind word, 2 repeats
        (" the old cat sits here today very calm.", 0.0),  # 1 kind + the animal - 2 words beyond 6
        (" good kind nice warm calm happy good good.", -1.0),  # the hack: 3 - 2 repeats - 2 too long
        ("", 0.0),
    ],
)
def test_the_preference_rule_by_hand(completion, score):
    assert true_preference_score("Describe the cat.", completion) == score


def test_preference_labels_agree_with_the_rule():
    train, held_out = split_pairs(2000, 500, seed=0)
    for row in train + held_out:
        gap = true_preference_score(row["prompt"], row["chosen"]) - true_preference_score(
            row["prompt"], row["rejected"]
        )
        assert gap > 0 and row["margin"] == gap, row


def rule_parts(prompt, completion):
    words = response_words(completion)
    return {
        "kind words": len({w for w in words if w in KIND_WORDS}),
        "animal": prompt.split()[-1].rstrip(".") in words,
        "repeats": len(words) - len(set(words)),
        "length": len(words) > 6,
    }


def test_every_part_of_the_rule_alone_decides_some_pairs():
    # a reward model can only learn a part of the rule that the data shows on its own
    train, _ = split_pairs(4000, 10, seed=0)
    alone = Counter()
    for row in train:
        chosen, rejected = rule_parts(row["prompt"], row["chosen"]), rule_parts(row["prompt"], row["rejected"])
        differ = [part for part in chosen if chosen[part] != rejected[part]]
        alone.update(differ if len(differ) == 1 else [])
    assert all(alone[part] > 0.01 * len(train) for part in ("kind words", "animal", "repeats", "length")), alone


def test_no_held_out_response_is_trained_on():
    train, held_out = split_pairs(5000, 500, seed=0)
    seen = {(r["prompt"], r[side]) for r in train for side in ("chosen", "rejected")}
    assert not seen & {(r["prompt"], r[side]) for r in held_out for side in ("chosen", "rejected")}


def test_label_noise_flips_training_labels_only():
    clean_train, clean_held_out = split_pairs(4000, 500, seed=0)
    noisy_train, noisy_held_out = split_pairs(4000, 500, seed=0, label_noise=LABEL_NOISE)
    assert noisy_held_out == clean_held_out
    flipped = [noisy["chosen"] == clean["rejected"] for noisy, clean in zip(noisy_train, clean_train, strict=True)]
    pairs = zip(noisy_train, clean_train, strict=True)
    assert all({n["chosen"], n["rejected"]} == {c["chosen"], c["rejected"]} for n, c in pairs)  # same pairs
    assert abs(sum(flipped) / len(flipped) - LABEL_NOISE) < 0.03
    assert get_task("preference_noisy")(4000, 500, 0).train == noisy_train
    with pytest.raises(ValueError, match="label_noise"):
        split_pairs(10, 10, seed=0, label_noise=1.5)


def best_accuracy_from_one_feature(train, test, feature):
    """Held-out accuracy of the best classifier that sees only `feature` of the two responses
    (their lengths, say): for each pair of values it predicts what training chose more often."""
    wins = Counter((feature(r["chosen"]), feature(r["rejected"])) for r in train)
    correct = 0.0
    for row in test:
        first, second = feature(row["chosen"]), feature(row["rejected"])
        right, wrong = wins[(first, second)], wins[(second, first)]
        correct += 1.0 if right > wrong else 0.5 if right == wrong else 0.0
    return correct / len(test)


def count_kind_words(text):
    return sum(word in KIND_WORDS for word in response_words(text))


def test_preference_is_not_decided_by_length_or_by_counting_kind_words():
    train, held_out = split_pairs(8000, 2000, seed=0)
    by_words = best_accuracy_from_one_feature(train, held_out, lambda text: len(text.split()))
    by_chars = best_accuracy_from_one_feature(train, held_out, len)
    # measured for seed 0: 0.70 on word counts, 0.65 on character counts
    assert 0.6 < by_words < 0.75 and 0.6 < by_chars < 0.75, (by_words, by_chars)
    # the exploitable proxy, counting kind words, fits part of the data only (measured: 0.79)
    proxy = best_accuracy_from_one_feature(train, held_out, count_kind_words)
    assert 0.7 < proxy < 0.85, proxy


def test_the_rule_is_hackable_by_piling_up_kind_words():
    prompt = "Describe the owl."
    honest, hack = " nice calm owl.", " good kind nice warm calm happy good kind nice."
    assert count_kind_words(hack) > count_kind_words(honest)
    assert true_preference_score(prompt, hack) < 0 < true_preference_score(prompt, honest)


def test_preference_sft_demonstrates_the_chosen_side_of_the_same_pairs():
    pairs, demos = get_task("preference")(200, 50, 4), get_task("preference_sft")(200, 50, 4)
    assert demos.reward == pairs.reward == "preference_rule"
    for rows, pair_rows in ((demos.train, pairs.train), (demos.held_out, pairs.held_out)):
        assert rows == [{"prompt": r["prompt"], "completion": r["chosen"]} for r in pair_rows]


def test_support_bot_rows_are_seeded_draws_of_every_hidden_issue():
    from posttrain.envs.support_bot import ISSUES

    task = get_task("support_bot")
    a, again, other = task(300, 60, 0), task(300, 60, 0), task(300, 60, 1)
    assert a == again and a.train != other.train and a.held_out != a.train[:60]
    assert {row["issue"] for row in a.train} == {row["issue"] for row in a.held_out} == {i.name for i in ISSUES}
    assert a.reward is None  # the environment's rewards score the episodes
