"""Sequence-scoring models for reward models: one scalar per sequence.

``AutoModelForSequenceClassification`` with one label; a reward model trained by
``posttrain rm`` is such a folder and loads back with plain transformers.

Where the score is read. transformers' own forward reads the logit at the rightmost token
that is not ``config.pad_token_id``. That is right for right or left padding when the pad id
is a token of its own, but when pad = EOS (what :func:`posttrain.models.loading.ensure_pad_token`
does for tokenizers without a pad) it skips the EOS that ends every response and reads the
token before it. :func:`sequence_scores` reads the last position of the *attention mask*
instead, with positions counted from the mask, so the score of a row does not depend on the
pad id, the padding side or the other rows of the batch.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel

from posttrain.models.loading import DtypeName, load_pretrained, read_config

log = logging.getLogger(__name__)


def build_reward_model(config: PretrainedConfig, *, pad_token_id: int | None = None, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised float32 scorer with the body of ``config`` (e.g. ``tiny_config(...)``).

    ``pad_token_id`` defaults to the config's; one must be set, because transformers refuses
    padded batches without it. The global torch random state is left as it was.
    """
    settings = {k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}
    pad = config.pad_token_id if pad_token_id is None else pad_token_id
    if pad is None:
        raise ValueError("the reward model needs a pad_token_id (pass the tokenizer's)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = config.__class__.from_dict({**settings, "num_labels": 1, "pad_token_id": pad})
        return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)


def reward_model_from_policy(policy: PreTrainedModel, pad_token_id: int, *, seed: int = 0) -> PreTrainedModel:
    """A scorer whose body starts from the policy's weights (a copy) and whose head is fresh."""
    scorer = build_reward_model(policy.config, pad_token_id=pad_token_id, seed=seed)
    getattr(scorer, scorer.base_model_prefix).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    parameter = next(policy.parameters())
    return scorer.to(parameter.device, dtype=parameter.dtype)


def load_reward_model(
    path: str | Path,
    *,
    dtype: DtypeName | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    pad_token_id: int | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> PreTrainedModel:
    """A scorer from a local folder, in eval mode: a saved reward model (sequence classifier
    with one label) loads as saved; a policy folder gives its body and a fresh head (drawn
    with ``seed``), the start of reward-model training. ``pad_token_id`` overrides the config's."""
    config = read_config(path, trust_remote_code=trust_remote_code)
    is_scorer = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
    pad = config.pad_token_id if pad_token_id is None else pad_token_id
    if pad is None:
        raise ValueError(
            f"{path}: the reward model's config has no pad_token_id; scores of padded batches would be "
            "wrong. Pass pad_token_id=tokenizer.pad_token_id"
        )
    model = load_pretrained(
        AutoModelForSequenceClassification,
        path,
        dtype=dtype,
        device=device,
        gradient_checkpointing=gradient_checkpointing,
        trust_remote_code=trust_remote_code,
        config_updates={"num_labels": 1, "pad_token_id": pad},
    )
    if not is_scorer:  # from_pretrained drew the new head from the global stream; redraw it reproducibly
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = model.score.weight
            fresh = torch.randn(weight.shape, generator=generator) * model.config.initializer_range
            weight.copy_(fresh.to(weight.dtype))
        log.info("reward model from %s: body from the policy folder, score head initialised here", path)
    return model.eval()


def last_token_index(attention_mask: Tensor) -> Tensor:
    """``[B, L] → [B]``: the position of each row's last real token (rightmost 1 of the mask)."""
    if not bool(attention_mask.any(-1).all()):
        raise ValueError("a row of the attention mask is all zeros: there is no token to score")
    return attention_mask.shape[-1] - 1 - attention_mask.long().flip(-1).argmax(-1)


def sequence_scores(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B]`` float32 scores: the head applied to the final hidden state of each row's last real
    token. Works for left or right padding and for pad = EOS; also through peft adapters.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    body = getattr(inner, inner.base_model_prefix)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).last_hidden_state
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    # only B hidden vectors go through the head, not B·L as in the transformers forward
    return inner.score(hidden[rows, last_token_index(attention_mask)]).squeeze(-1).float()
