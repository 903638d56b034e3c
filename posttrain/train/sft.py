"""Supervised fine-tuning on prompt/completion rows.

The loss is the negative mean log-prob of the completion tokens and the EOS after them; the
prompt is context only. Each row is tokenised as prompt ids + completion ids + EOS, with no
BOS: exactly the token sequence an RL rollout later sees (the prompt, then what the policy
generates up to EOS), so what SFT teaches is what generation starts from.

Training is :class:`SFTObjective` in the one offline loop (``train/offline.py``), for
``posttrain sft`` and the demo alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.algos import sft_loss
from posttrain.models.logprobs import token_logprobs
from posttrain.models.packing import packed_token_logprobs

Example = tuple[list[int], list[int]]  # (input_ids, loss_mask)


def encode_row(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], completion: str | list[dict]) -> Example:
    """(input_ids, loss_mask) for prompt + completion + EOS; the mask is 1 on completion and EOS.
    A prompt given as chat messages goes through the chat template, the assistant's turn opened;
    a completion given as messages (TRL's conversational form) is encoded by ``reply_ids``."""
    from posttrain.models.chat import prompt_ids as encode_prompt
    from posttrain.models.chat import reply_ids

    if not isinstance(completion, str):
        prompt_ids, completion_ids = reply_ids(tokenizer, prompt, completion)
        return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
    # Tokenised separately, so the prompt's ids are the same as at generation time even for
    # subword tokenizers that would merge across the prompt/completion boundary.
    prompt_ids = encode_prompt(tokenizer, prompt)
    completion_ids = [*tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)


def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad to the longest example: input_ids, attention_mask, loss_mask, each [B, T]."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def completion_logprobs(model: PreTrainedModel, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(log-probs, mask) of the target tokens from the batch's first completion token on.

    Position t predicts token t + 1, so the mask is read on the shifted targets. Logits are
    computed only from the position before the earliest completion token (``logits_to_keep``):
    prompt positions are never targets, and for long prompts over a large vocabulary their
    ``[B, T, V]`` logits would be most of the step's memory and a good part of its arithmetic.
    """
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    targets = loss_mask[:, 1:].any(0).nonzero()
    first = int(targets[0]) + 1 if len(targets) else input_ids.shape[1] - 1  # earliest target position
    keep = input_ids.shape[1] - first + 1
    logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"], logits_to_keep=keep).logits
    return token_logprobs(logits[:, :-1], input_ids[:, first:]), loss_mask[:, first:]


def sft_batch_loss(model: PreTrainedModel, batch: Mapping[str, Tensor]) -> Tensor:
    """Token-mean negative log-likelihood of the masked tokens of a collated batch."""
    logprobs, mask = completion_logprobs(model, batch)
    return sft_loss(logprobs, mask, agg_mode="token-mean")


class SFTObjective:
    """Negative log-likelihood of completion tokens, as an objective of the offline loop.

    Examples are ``(input_ids, loss_mask)`` from :func:`encode_row`. The loss of a
    micro-batch is the sum of its completion-token NLLs divided by the completion tokens of
    the whole optimizer step, i.e. ``token-mean`` over the step however it is split into
    micro-batches (docs/algorithms.md §1.2, note on gradient accumulation).

    With ``packing``, the loop's items are packed rows (tuples of examples, from
    :func:`posttrain.train.packing.pack_examples`) instead of examples; the units stay the
    completion tokens of every example, so the loss does not depend on how rows were packed.
    Each step logs ``train/padding_fraction``: the share of the padded batch that is padding
    (0 packed: a pass's rows are laid end to end in one row).
    """

    loss_name = "loss/sft"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, packing: bool = False) -> None:
        self.model, self.tokenizer, self.packing = model, tokenizer, packing

    def encode(self, row: Mapping[str, Any], max_tokens: int | None = None) -> Example:
        """Prompt/completion rows, or conversations (``messages``, optionally with ``tools``
        schemas): then every assistant turn is trained — a tool call as a final answer — and
        everything else is context (``envs/conversation.py``). A conversation longer than
        ``max_tokens`` is measured, not assembled: the caller refuses or skips it by its length."""
        if "messages" in row:
            from posttrain.envs.conversation import conversation_example

            return conversation_example(self.tokenizer, row["messages"], tools=row.get("tools"), max_tokens=max_tokens)
        return encode_row(self.tokenizer, row["prompt"], row["completion"])

    def units(self, examples: Sequence[Any]) -> float:
        # position 0 is never a target (nothing predicts it), matching the shift in the loss;
        # packed, an example's first token is not one either (collate_packed clears it)
        if self.packing:
            examples = [example for pack in examples for example in pack]
        return float(sum(sum(mask[1:]) for _, mask in examples))

    def loss(self, examples: Sequence[Any], step_units: float) -> tuple[Tensor, dict[str, float]]:
        from posttrain.train.packing import packed_examples, padding_fraction

        device = next(self.model.parameters()).device
        if self.packing:  # the pass's rows end to end, no padding (train/packing.py)
            logprobs, _ = packed_token_logprobs(self.model, packed_examples(examples, device))
            loss = sft_loss(logprobs[None], torch.ones_like(logprobs)[None], "token-mean", num_tokens=step_units)
            return loss, {"train/padding_fraction": 0.0}
        collated = collate(examples, self.tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in collated.items()}
        logprobs, mask = completion_logprobs(self.model, batch)
        loss = sft_loss(logprobs, mask, agg_mode="token-mean", num_tokens=step_units)
        return loss, {"train/padding_fraction": padding_fraction([len(ids) for ids, _ in examples])}
