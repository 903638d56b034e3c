"""The critic: a causal-LM body with a scalar head, one value per position.

Built as ``AutoModelForTokenClassification`` with one label, which transformers provides for
Llama, Qwen2 and most decoder families: the body is the policy's, the head a ``[hidden, 1]``
linear layer, and the folder it saves loads back with plain transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForTokenClassification

from posttrain.models.loading import check_model_folder


def value_model_from_policy(policy: Any, *, head_std: float = 0.0) -> Any:
    """A critic initialised from the policy's weights (a copy; the policy is not shared).

    The head starts at zero by default, so initial values are 0 and early GAE advantages are
    the raw returns rather than noise from a random head.
    """
    settings = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    # no dropout before the head: a value target regressed through dropout is noise
    config = policy.config.__class__.from_dict({**settings, "num_labels": 1, "classifier_dropout": 0.0})
    critic = AutoModelForTokenClassification.from_config(config)
    body_name = critic.base_model_prefix
    getattr(critic, body_name).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    with torch.no_grad():
        head = critic.score if hasattr(critic, "score") else critic.classifier
        torch.nn.init.normal_(head.weight, std=head_std) if head_std else head.weight.zero_()
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()
    return critic.to(next(policy.parameters()).device, dtype=next(policy.parameters()).dtype)


def load_value_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Any:
    """A critic saved by ``save_pretrained`` (or any token-classification folder with 1 label)."""
    return AutoModelForTokenClassification.from_pretrained(check_model_folder(path), dtype=dtype, local_files_only=True)


def values(critic: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, T]`` value estimates; positions follow the attention mask like the policy's."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[..., 0].float()
