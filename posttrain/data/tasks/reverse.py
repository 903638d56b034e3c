"""Reverse a name: ``"Reverse the name: sean. Answer:"`` → ``" naes."``.

The lecture's first example (seed 000): SFT teaches the format, then RL with a 0/1
exact-match reward. Names are generated, not downloaded: pronounceable lowercase strings
built from alternating consonant and vowel clusters, 3-8 letters, the same for the same seed.
The held-out split always starts with the lecture's nine hand-picked names, which never appear
in training, so its "Manual Examples" table can be printed for any run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from posttrain.data.loading import DataError

PROMPT_TEMPLATE = "Reverse the name: {name}. Answer:"
PROMPT_MARKER = "Reverse the name:"
ANSWER_MARKER = "Answer:"
MANUAL_NAMES = ("sean", "joel", "chen", "dareen", "neel", "akshita", "ashish", "manan", "sanidhya")

# Clusters are repeated to weight them: single letters are the common case, so most names
# read like "dareen" or "manan" rather than a chain of digraphs.
_CONSONANTS = (
    *"bcdfghjklmnprstvyz" * 3,
    *("ch", "sh", "th", "dh", "kr", "nd", "sk", "st", "br", "tr", "ng", "ks", "ny"),
)
_VOWELS = (*"aeiou" * 4, *("ee", "ai", "ea", "oo", "ia", "ou"))
_MAX_TRIES_PER_NAME = 1000


def make_name(rng: random.Random, min_len: int = 3, max_len: int = 8) -> str:
    """One name: alternate consonant/vowel clusters, cut to a length drawn in [min_len, max_len]."""
    length = rng.randint(min_len, max_len)
    use_vowel = rng.random() < 0.3  # most names open with a consonant, some like "akshita" do not
    name = ""
    while len(name) < length:
        name += rng.choice(_VOWELS if use_vowel else _CONSONANTS)
        use_vowel = not use_vowel
    return name[:length]


def make_names(n: int, *, seed: int, min_len: int = 3, max_len: int = 8, exclude: Sequence[str] = ()) -> list[str]:
    """`n` distinct names, none in `exclude`, in a fixed order for a given `seed`."""
    rng = random.Random(seed)
    seen, names = set(exclude), []
    tries = 0
    while len(names) < n:
        tries += 1
        if tries > _MAX_TRIES_PER_NAME * max(n, 1):
            raise DataError(f"could not find {n} distinct names of {min_len}-{max_len} letters")
        name = make_name(rng, min_len, max_len)
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def split_names(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[str], list[str]]:
    """Disjoint (train, held_out) name lists; held_out = MANUAL_NAMES + generated names.

    Held-out names are drawn before training names, so the held-out set of a given size and
    seed stays the same whatever `n_train` is.
    """
    if n_test < len(MANUAL_NAMES):
        raise DataError(
            f"the reverse task holds out at least {len(MANUAL_NAMES)} rows (the hand-picked names); {n_test} asked for"
        )
    names = make_names(n_test - len(MANUAL_NAMES) + n_train, seed=seed, exclude=MANUAL_NAMES)
    held_out = [*MANUAL_NAMES, *names[: n_test - len(MANUAL_NAMES)]]
    return names[n_test - len(MANUAL_NAMES) :], held_out


def make_prompt(name: str) -> str:
    """The task prompt for `name`; it ends at "Answer:" with no trailing space."""
    return PROMPT_TEMPLATE.format(name=name)


def make_rows(names: Sequence[str]) -> list[dict[str, str]]:
    """Prompt/completion rows. The completion starts with a space and ends with "." ; the
    trainer appends EOS."""
    return [{"prompt": make_prompt(name), "completion": f" {name[::-1]}.", "name": name} for name in names]


def _as_text(value: Any) -> str:
    """A string as is; conversational data (a list of {"role", "content"} messages) joined."""
    if isinstance(value, str):
        return value
    return "\n".join(message["content"] for message in value)


def parse_answer(completion: str) -> str:
    """The lecture's parse: the text after the last "Answer:", up to the first ".", stripped.

    Like the lecture's code, an answer with no "." is read to the end of the text.
    """
    return completion.split(ANSWER_MARKER)[-1].split(".")[0].strip()


def reverse_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None = None,
    **columns: Any,
) -> list[float | None]:
    """1.0 if the parsed answer is the prompt's name reversed, else 0.0.

    The target comes from the prompt text, as in the lecture (text after "Reverse the name:"
    up to the first "."), so the function needs no extra column. A prompt that is not a
    reverse prompt gets ``None``: this reward does not apply to it (TRL's convention when
    several tasks share a batch).
    """
    rewards: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        prompt_text = _as_text(prompt)
        if PROMPT_MARKER not in prompt_text:
            rewards.append(None)
            continue
        target = prompt_text.split(PROMPT_MARKER)[-1].split(".")[0].strip()
        rewards.append(1.0 if parse_answer(_as_text(completion)) == target[::-1] else 0.0)
    return rewards
