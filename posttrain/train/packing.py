"""SFT packing: several examples in one row of up to ``max_length`` tokens, none seeing another.

Packing (TRL's ``SFTConfig(packing=True)``) trades padding for concatenation. Done naively it
is wrong in two ways TRL users keep reporting: the tokens of an example attend to the examples
packed before it, and positions run on across examples, so a packed example is seen at offsets
it never has at generation time. Here the rows of a pass are laid end to end in one row
(``models/packing.py``): position ids restart at 0 at every example's first token, and attention
stays within each example (the examples' offsets go to the attention kernel; no mask is built).
With both, each example's log-probs equal those of the example alone (tests/train/test_packing.py).
Only an example's loss-mask tokens after its first are scored: alone, nothing predicts its first
token, and packed, the previous example's last token would.

How rows are formed: once, before training, the examples are visited in a seeded random order
and each goes into the first row with room for it (greedy first-fit). The rows are then the
units the sampler shuffles each epoch; ``batch_size`` counts them, and ``max_length`` bounds
what one row holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.models.packing import PackedRow, packed_row

Example = tuple[list[int], list[int]]  # (input_ids, loss_mask), as sft.encode_row makes them
Pack = tuple[Example, ...]


def pack_examples(examples: Sequence[Example], max_length: int, seed: int) -> list[Pack]:
    """Greedy first-fit of ``examples`` (visited in the order ``randperm(seed)``) into rows of at
    most ``max_length`` tokens. Every example must fit alone (checked before, naming its row)."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    bins: list[list[Example]] = []
    room: list[int] = []
    for index in order:
        example = examples[index]
        size = len(example[0])
        if size > max_length:
            raise ValueError(f"example {index} has {size} tokens, more than max_length={max_length}")
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(example)
                room[b] -= size
                break
        else:
            bins.append([example])
            room.append(max_length - size)
    return [tuple(b) for b in bins]


def packed_examples(packs: Sequence[Pack], device: torch.device | str = "cpu") -> PackedRow:
    """The examples of ``packs`` end to end in one row, each its own document, scoring every
    loss-mask token of an example after its first."""
    examples = [example for pack in packs for example in pack]
    ids = torch.tensor([token for tokens, _ in examples for token in tokens], dtype=torch.long, device=device)
    lengths = torch.tensor([len(tokens) for tokens, _ in examples], dtype=torch.long, device=device)
    predictors, start = [], 0
    for tokens, mask in examples:
        predictors += [start + j - 1 for j in range(1, len(tokens)) if mask[j]]
        start += len(tokens)
    return packed_row(ids, lengths, torch.tensor(predictors, dtype=torch.long, device=device))


def padding_fraction(lengths: Sequence[int]) -> float:
    """Share of a right-padded [B, max(lengths)] batch that is padding."""
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))
