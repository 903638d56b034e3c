"""A synthetic preference task whose "human raters" are a fixed rule (seeds 000–002, RLHF).

Prompt: ``Describe the <animal>.``; a response is a few words. The rule that labels pairs —
:func:`true_preference_score` — stands in for human judgement, so the *true* preference of
any completion can be measured later (e.g. while a policy optimises a learned reward model):

* +1 per distinct kind word (good, kind, nice, warm, calm, happy), up to 3;
* +1 when the response names the animal;
* −1 per repeated word (a word that already occurred);
* −0.5 per word beyond 6.

A reward model that only learns "kind words are good" is exploitable: repeating kind words
raises such a model's score while the rule penalises every repetition — reward hacking that
the KL penalty is there to contain.
"""

from __future__ import annotations

import random

ANIMALS = ("cat", "dog", "fox", "owl", "cow", "bee", "elk", "yak", "ram", "hen")
KIND_WORDS = ("good", "kind", "nice", "warm", "calm", "happy")
PLAIN_WORDS = ("the", "a", "is", "very", "big", "small", "brown", "old", "runs", "sits", "here", "today")
PROMPT_TEMPLATE = "Describe the {animal}."


def true_preference_score(prompt: str, completion: str) -> float:
    """The rule's score of a response (higher is better); see the module docstring."""
    words = [w.strip(".,!?").lower() for w in completion.split()]
    words = [w for w in words if w]
    animal = prompt.removeprefix("Describe the ").rstrip(".").strip().lower()
    kind = len({w for w in words if w in KIND_WORDS})
    repeats = len(words) - len(set(words))
    return min(kind, 3) + float(animal in words) - repeats - 0.5 * max(0, len(words) - 6)


def random_response(rng: random.Random, animal: str) -> str:
    length = rng.randint(2, 9)
    pool = [*KIND_WORDS, *PLAIN_WORDS, animal]
    return " " + " ".join(rng.choice(pool) for _ in range(length)) + "."


def make_pairs(n: int, *, seed: int, label_noise: float = 0.0) -> list[dict]:
    """``n`` rows ``{prompt, chosen, rejected, margin}`` labelled by the rule (ties skipped);
    with ``label_noise`` a share of pairs is flipped, like disagreeing raters."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        animal = rng.choice(ANIMALS)
        prompt = PROMPT_TEMPLATE.format(animal=animal)
        first, second = random_response(rng, animal), random_response(rng, animal)
        a, b = true_preference_score(prompt, first), true_preference_score(prompt, second)
        if a == b:
            continue
        chosen, rejected = (first, second) if a > b else (second, first)
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": abs(a - b)})
    return rows


def split_pairs(n_train: int, n_test: int, *, seed: int = 0, label_noise: float = 0.0) -> tuple[list, list]:
    """Train pairs (optionally noisy) and clean held-out pairs from a different seed stream."""
    return make_pairs(n_train, seed=seed, label_noise=label_noise), make_pairs(n_test, seed=seed + 10_007)
