"""Sequence-scoring models for reward models: one scalar per sequence.

``AutoModelForSequenceClassification`` with one label: the score of a sequence is the logit at
its last non-pad token (transformers finds it from ``config.pad_token_id``, which must be set
for batches with padding). A reward model trained by ``posttrain rm`` is such a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from posttrain.models.loading import check_model_folder


def reward_model_from_policy(policy: Any, pad_token_id: int) -> Any:
    """A scorer whose body starts from the policy's weights (a copy) and whose head is fresh."""
    settings = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    config = policy.config.__class__.from_dict({**settings, "num_labels": 1, "pad_token_id": pad_token_id})
    scorer = AutoModelForSequenceClassification.from_config(config)
    getattr(scorer, scorer.base_model_prefix).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    return scorer.to(next(policy.parameters()).device, dtype=next(policy.parameters()).dtype)


def load_reward_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Any:
    """A sequence-scoring folder (e.g. ``<run>/final`` of ``posttrain rm``), in eval mode."""
    model = AutoModelForSequenceClassification.from_pretrained(
        check_model_folder(path), dtype=dtype, local_files_only=True
    )
    if model.config.pad_token_id is None:
        raise ValueError(
            f"{path}: the reward model's config has no pad_token_id; scores of padded batches would be wrong"
        )
    return model.eval()
