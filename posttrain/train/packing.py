"""SFT packing: several examples in one row of up to ``max_length`` tokens, none seeing another.

Packing (TRL's ``SFTConfig(packing=True)``) trades padding for concatenation. Done naively it
is wrong in two ways TRL users keep reporting: the tokens of an example attend to the examples
packed before it, and positions run on across examples, so a packed example is seen at offsets
it never has at generation time. Here each row carries

- ``position_ids`` restarting at 0 at every example's first token, and
- a block-diagonal causal mask ``[B, 1, T, T]``: query i sees key j iff j <= i and both belong
  to the same example. It is *additive* (0 where allowed, the dtype's minimum elsewhere): the
  form both the ``sdpa`` and the ``eager`` attention of transformers' Llama/Qwen2 take as is
  (``masking_utils`` passes a 4D mask through untouched; eager adds it to the scores, so a
  boolean mask would be wrong there).

With both, each example's log-probs equal those of the example alone (tests/train/test_packing.py).
The loss mask keeps each example's own mask, with its first token cleared: alone, nothing
predicts that token, and packed, the previous example's last token would.

How rows are formed: once, before training, the examples are visited in a seeded random order
and each goes into the first row with room for it (greedy first-fit). The rows are then the
units the sampler shuffles each epoch; ``batch_size`` counts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

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


def collate_packed(packs: Sequence[Pack], pad_token_id: int, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """input_ids, position_ids, loss_mask [B, T] and the additive block-diagonal causal
    attention_mask [B, 1, T, T] (``dtype``: the model's) of packed rows, right-padded to the
    longest row. A padding token is a segment of its own (it sees only itself), so no row of
    the mask is empty (an all-masked softmax row would be NaN)."""
    width = max(sum(len(ids) for ids, _ in pack) for pack in packs)
    batch = len(packs)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)
    # segment id per token: the example's number, or -(position + 1) for padding (unique)
    segments = -torch.arange(1, width + 1).repeat(batch, 1)
    for row, pack in enumerate(packs):
        start = 0
        for number, (ids, mask) in enumerate(pack):
            end = start + len(ids)
            input_ids[row, start:end] = torch.tensor(ids)
            position_ids[row, start:end] = torch.arange(len(ids))
            loss_mask[row, start:end] = torch.tensor(mask, dtype=torch.float32)
            loss_mask[row, start] = 0.0  # nothing of its own predicts an example's first token
            segments[row, start:end] = number
            start = end
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = same & causal
    attention_mask = torch.zeros((batch, 1, width, width), dtype=dtype)
    attention_mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
    }


def padding_fraction(lengths: Sequence[int]) -> float:
    """Share of a right-padded [B, max(lengths)] batch that is padding."""
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))
