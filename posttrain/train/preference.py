"""Reward-model (Bradley–Terry) and DPO-family objectives for the offline loop.

Both read preference rows ``{"prompt", "chosen", "rejected"}`` (optionally ``margin``) and
encode each side as prompt + response + EOS, the same token sequence a rollout would
produce, so a reward model scores exactly what the policy later generates.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import bradley_terry_loss, dpo_loss
from posttrain.models.logprobs import token_logprobs
from posttrain.models.reward import sequence_scores
from posttrain.train.sft import collate, encode_row


@dataclass(frozen=True)
class PairExample:
    chosen: tuple[list[int], list[int]]  # (input_ids, response mask) of prompt + chosen + EOS
    rejected: tuple[list[int], list[int]]
    margin: float | None


def encode_pair(tokenizer: Any, row: Mapping[str, Any]) -> PairExample:
    margin = row.get("margin")
    return PairExample(
        chosen=encode_row(tokenizer, row["prompt"], row["chosen"]),
        rejected=encode_row(tokenizer, row["prompt"], row["rejected"]),
        margin=None if margin is None else float(margin),
    )


def _both_sides(examples: Sequence[PairExample], pad_id: int, device: torch.device) -> dict[str, Tensor]:
    """Chosen rows first, then rejected rows, in one right-padded batch (one forward pass)."""
    sides = [e.chosen for e in examples] + [e.rejected for e in examples]
    return {k: v.to(device) for k, v in collate(sides, pad_id).items()}


class RewardModelObjective:
    """Bradley–Terry: mean(−log σ(r_w − r_l − m)) + c·mean((r_w + r_l)²) (docs/algorithms.md §5.5).

    ``model`` is a sequence-scoring model (``AutoModelForSequenceClassification`` with one
    label): its score of a sequence is the logit at the last non-pad token.
    """

    loss_name = "loss/rm"

    def __init__(self, model: nn.Module, tokenizer: Any, *, center_coef: float = 0.0) -> None:
        self.model, self.tokenizer, self.center_coef = model, tokenizer, center_coef

    def encode(self, row: Mapping[str, Any], max_tokens: int | None = None) -> PairExample:
        # a pair is two renderings, linear in its length: nothing for ``max_tokens`` to save
        return encode_pair(self.tokenizer, row)

    def units(self, examples: Sequence[PairExample]) -> float:
        return float(len(examples))

    def scores(self, examples: Sequence[PairExample]) -> tuple[Tensor, Tensor]:
        device = next(self.model.parameters()).device
        batch = _both_sides(examples, self.tokenizer.pad_token_id, device)
        # read at the last real token by the attention mask: correct also when pad = EOS,
        # where transformers' pooled logit would skip the final EOS
        scores = sequence_scores(self.model, batch["input_ids"], batch["attention_mask"])
        return scores[: len(examples)], scores[len(examples) :]

    def loss(self, examples: Sequence[PairExample], step_units: float) -> tuple[Tensor, dict[str, float]]:
        chosen, rejected = self.scores(examples)
        margins = [e.margin for e in examples]
        margin = None if all(m is None for m in margins) else torch.tensor([m or 0.0 for m in margins])
        loss, metrics = bradley_terry_loss(chosen, rejected, margin, center_coef=self.center_coef)
        # bradley_terry_loss is a mean over this micro-batch; rescale to the step's pairs
        return loss * len(examples) / step_units, {f"rm/{k}": float(v) for k, v in metrics.items()}

    @torch.no_grad()
    def pairwise_accuracy(self, examples: Sequence[PairExample], batch_size: int = 64) -> float:
        """Share of pairs whose chosen response scores higher (held-out evaluation)."""
        was_training = self.model.training
        self.model.eval()
        correct = 0
        for start in range(0, len(examples), batch_size):
            chosen, rejected = self.scores(examples[start : start + batch_size])
            correct += int((chosen > rejected).sum())
        self.model.train(was_training)
        return correct / max(len(examples), 1)


def sequence_logprob_sums(model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Σ_t log π(y_t | …) over each row's response tokens, and the response lengths. ``[2N]``."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logprobs = token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:]
    return (logprobs * mask).sum(-1), mask.sum(-1)


class DPOObjective:
    """The DPO family (sigmoid, ipo, hinge, robust; label smoothing = cDPO) on summed
    completion log-probs against a frozen reference, plus ``nll_coef`` × the chosen responses'
    NLL per token (RPO; docs/algorithms.md §5.1–5.4, 5.6).

    The reference is a frozen copy of the initial policy unless ``reference`` is given (with
    LoRA, pass the policy itself and a ``reference_context`` that disables the adapters, so
    no second copy lives in memory). Reference log-probs are computed without gradients,
    once per micro-batch.
    """

    loss_name = "loss/dpo"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        nll_coef: float = 0.0,
        reference: nn.Module | None = None,
        reference_context: Any = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.nll_coef = nll_coef
        self.reference_context = reference_context
        if reference is None and reference_context is None:
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.reference = reference if reference is not None else model

    def encode(self, row: Mapping[str, Any], max_tokens: int | None = None) -> PairExample:
        # a pair is two renderings, linear in its length: nothing for ``max_tokens`` to save
        return encode_pair(self.tokenizer, row)

    def units(self, examples: Sequence[PairExample]) -> float:
        return float(len(examples))

    def loss(self, examples: Sequence[PairExample], step_units: float) -> tuple[Tensor, dict[str, float]]:
        device = next(self.model.parameters()).device
        batch = _both_sides(examples, self.tokenizer.pad_token_id, device)
        n = len(examples)
        with torch.no_grad(), self.reference_context() if self.reference_context else contextlib.nullcontext():
            reference_sums, _ = sequence_logprob_sums(self.reference, batch)
        policy_sums, lengths = sequence_logprob_sums(self.model, batch)
        loss, metrics = dpo_loss(
            policy_sums[:n],
            policy_sums[n:],
            reference_sums[:n],
            reference_sums[n:],
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            nll_coef=self.nll_coef,
            chosen_lengths=lengths[:n],
            rejected_lengths=lengths[n:],
        )
        return loss * n / step_units, {f"dpo/{k.split('/')[-1]}": float(v) for k, v in metrics.items()}
