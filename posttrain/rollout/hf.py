"""The transformers forward as a decoding backend, for architectures the native one lacks."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TransformersDecoder:
    """Same interface as :class:`posttrain.rollout.native.NativeDecoder`, using the model's
    own forward and cache. Slower at small sizes (per-step overhead), right for any model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def refresh(self) -> None:
        """Nothing is derived from the weights here."""

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, repeats: int = 1) -> Tensor:
        input_ids = input_ids.repeat_interleave(repeats, 0)
        attention_mask = attention_mask.repeat_interleave(repeats, 0)
        self.attention_mask = attention_mask
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
        self.cache = out.past_key_values
        self.next_position = positions[:, -1:] + 1
        return out.logits[:, -1]

    @torch.inference_mode()
    def decode(self, tokens: Tensor) -> Tensor:
        ones = torch.ones_like(self.attention_mask[:, :1])
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)
        out = self.model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=self.attention_mask,
            position_ids=self.next_position,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.next_position = self.next_position + 1
        return out.logits[:, -1]
