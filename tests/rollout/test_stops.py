"""Stop strings (rollout/stops.py): only rows whose new tokens could complete a stop string are
decoded, and that finds exactly what decoding every live row finds — also where a string's last
character arrives split over byte tokens, or ends in whitespace."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.tokenizers import build_char_tokenizer, train_bpe_tokenizer
from posttrain.rollout.stops import StopStrings

TEXTS = [f"Le café n°{i} coûte {i % 7} €.\nAu revoir。 ab cd" for i in range(200)]


class CountingTokenizer:
    """A tokenizer that counts the sequences it decodes (a fresh object: its own cache of ids)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def batch_decode(self, sequences, **kwargs):
        self.decoded += len(sequences)
        return self.tokenizer.batch_decode(sequences, **kwargs)


@pytest.fixture(scope="module")
def tokenizers():
    return {"char": build_char_tokenizer(), "byte_bpe": train_bpe_tokenizer(TEXTS, vocab_size=300)}


def streams(tokenizer, rows: int, steps: int, seed: int) -> torch.Tensor:
    """Random token ids, a third of them drawn from tokens of the texts (stop strings occur)."""
    rng = torch.Generator().manual_seed(seed)
    common = torch.tensor(sorted({t for text in TEXTS[:20] for t in tokenizer(text)["input_ids"]}))
    anything = torch.randint(0, len(tokenizer), (rows, steps), generator=rng)
    picked = common[torch.randint(0, len(common), (rows, steps), generator=rng)]
    return torch.where(torch.rand(rows, steps, generator=rng) < 0.33, picked, anything)


ASCII_STOPS = [["."], ["\n"], ["b c", "a"]]  # the character tokenizer's alphabet holds these
OTHER_STOPS = [["é"], ["€.", "。"], ["ab", "n°1"]]  # split over byte tokens by the byte-level BPE


@pytest.mark.parametrize(
    ("name", "stops"), [("char", s) for s in ASCII_STOPS] + [("byte_bpe", s) for s in ASCII_STOPS + OTHER_STOPS]
)
def test_looking_every_few_steps_finds_what_decoding_every_row_finds(tokenizers, name, stops):
    tokenizer = tokenizers[name]
    tokens, counting = streams(tokenizer, 24, 30, seed=len(name) + len(stops)), CountingTokenizer(tokenizer)

    def look(prefilter: bool) -> tuple[torch.Tensor, int]:
        """The first ending step of every look (a look every 3 steps, as fixed-shape decoding
        does) and how many sequences were decoded for it."""
        strings, alive, firsts = StopStrings(counting, stops, 24, prefilter), torch.ones(24, dtype=torch.bool), []
        counting.decoded = 0
        for start in range(0, 30, 3):
            first = strings.first_hits(tokens[:, start : start + 3], alive)
            firsts.append(first)
            alive &= first < 0
        return torch.stack(firsts), counting.decoded

    look(True)  # the ids' lone texts are decoded once per tokenizer (a cache): not counted below
    found, decoded = zip(look(True), look(False), strict=True)
    assert torch.equal(found[0], found[1])
    assert (found[0] >= 0).any(), "no stop string occurred: the comparison shows nothing"
    if not stops[-1][-1].isspace():  # a whitespace ending makes every token a candidate
        assert decoded[0] < decoded[1]


@pytest.mark.parametrize("stops", [["é"], ["€.", "ab"], [" c"]])
def test_step_by_step_updates_find_what_decoding_every_row_finds(tokenizers, stops):
    tokenizer = tokenizers["byte_bpe"]
    tokens, rows = streams(tokenizer, 16, 24, seed=3), torch.arange(16).flip(0)
    hits = []
    for prefilter in (True, False):
        strings, alive, per_step = StopStrings(tokenizer, stops, 16, prefilter), torch.ones(16, dtype=torch.bool), []
        for step in range(24):
            hit = strings.update(tokens[:, step], rows, alive)
            per_step.append(hit)
            alive &= ~hit
        hits.append(torch.stack(per_step))
    assert torch.equal(hits[0], hits[1]) and hits[0].any()
