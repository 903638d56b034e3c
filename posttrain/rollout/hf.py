"""The transformers forward as a decoding backend, for architectures the native one lacks."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from posttrain.models.cache import cache_argument, returned_cache


class TransformersDecoder:
    """Same interface as :class:`posttrain.rollout.native.NativeDecoder`, using the model's
    own forward and KV cache. Right for any causal LM (adapters, sliding
    windows, other rotary variants); slower at small sizes, where per-step overhead rules."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # logits for the last position only: the prefill otherwise projects every prompt token
        self.last_only = "logits_to_keep" in inspect.signature(model.forward).parameters

    def refresh(self) -> None:
        """Nothing is derived from the weights here."""

    def _forward(self, input_ids: Tensor, positions: Tensor, past: object | None) -> Tensor:
        extra = {"logits_to_keep": 1} if self.last_only else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.attention_mask,
            position_ids=positions,
            use_cache=True,
            **cache_argument(self.model, past),
            **extra,
        )
        self.cache = returned_cache(out)
        return out.logits[:, -1]

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, repeats: int = 1) -> Tensor:
        """Encode left-padded prompts ``[U, P]`` once, copy the cache for the ``repeats``
        samples of each; return next-token logits ``[U·repeats, V]``, prompt-major."""
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.attention_mask = attention_mask
        logits = self._forward(input_ids, positions, None)
        if not hasattr(self.cache, "batch_repeat_interleave"):
            raise TypeError(f"{type(self.cache).__name__} is not a transformers Cache; the fallback engine needs one")
        self.cache.batch_repeat_interleave(repeats)
        self.attention_mask = attention_mask.repeat_interleave(repeats, 0)
        self.next_position = positions[:, -1:].repeat_interleave(repeats, 0) + 1
        return logits.repeat_interleave(repeats, 0)

    @torch.inference_mode()
    def decode(self, tokens: Tensor) -> Tensor:
        """Append one token per row ``[B]``; return next-token logits ``[B, V]``."""
        self.attention_mask = torch.cat([self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], dim=-1)
        logits = self._forward(tokens.unsqueeze(-1), self.next_position, self.cache)
        self.next_position = self.next_position + 1
        return logits

    def release(self) -> int:
        """Free the last batch's cache; returns 0 (its size is the cache class's business)."""
        self.cache = self.attention_mask = self.next_position = None
        return 0

    @torch.inference_mode()
    def select(self, rows: Tensor) -> None:
        """Keep only the running rows ``rows [B']``."""
        self.cache.batch_select_indices(rows)
        self.attention_mask, self.next_position = self.attention_mask[rows], self.next_position[rows]
