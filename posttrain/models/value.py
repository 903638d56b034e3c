"""The critic: a causal-LM body with a scalar head, one value per position.

Built as ``AutoModelForTokenClassification`` with one label, which transformers provides for
Llama, Qwen2 and most decoder families: the body is the policy's, the head a ``[hidden, 1]``
linear layer (with bias). ``critic.save_pretrained(dir)`` writes an ordinary folder that
``AutoModelForTokenClassification.from_pretrained(dir)`` loads back with plain transformers,
so a critic needs no posttrain-specific format.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification, PreTrainedModel

from posttrain.models.loading import DtypeName, load_pretrained, read_config

log = logging.getLogger(__name__)

# no dropout before the head: a value target regressed through dropout is noise
# (transformers' token classifiers default to 0.1)
_CRITIC_CONFIG = {"num_labels": 1, "classifier_dropout": 0.0}


def value_model_from_policy(policy: PreTrainedModel, *, head_std: float = 0.0) -> PreTrainedModel:
    """A critic initialised from the policy's weights (a copy; the policy is not shared; of a LoRA
    policy, its base weights).

    The head starts at zero by default, so initial values are 0 and early GAE advantages are
    the raw returns rather than noise from a random head; ``head_std > 0`` draws it from
    N(0, head_std²) instead. Same dtype and device as the policy.
    """
    if hasattr(policy, "get_base_model"):  # LoRA (peft): the base weights, the adapters left out
        from posttrain.models.lora import base_weights

        policy = policy.get_base_model()
        body = base_weights(getattr(policy, policy.base_model_prefix))
    else:
        body = getattr(policy, policy.base_model_prefix).state_dict()
    settings = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    config = policy.config.__class__.from_dict({**settings, **_CRITIC_CONFIG})
    critic = AutoModelForTokenClassification.from_config(config)
    getattr(critic, critic.base_model_prefix).load_state_dict(body)
    init_value_head(critic, head_std)
    parameter = next(policy.parameters())
    return critic.to(parameter.device, dtype=parameter.dtype)


def load_value_model(
    path: str | Path,
    *,
    dtype: DtypeName | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    head_std: float = 0.0,
) -> PreTrainedModel:
    """A critic from a local folder: a saved critic (token classifier with one label) loads as
    it was saved; a reward model (a sequence classifier with one label, ``posttrain rm``) gives
    its body and its scalar head, read at every position (its head has no bias: the critic's
    starts at zero); a policy folder (a causal LM) gives its body and a fresh head as in
    :func:`value_model_from_policy`. Either way the head has no dropout."""
    architectures = read_config(path, trust_remote_code=trust_remote_code).architectures or []
    is_critic = any(name.endswith("ForTokenClassification") for name in architectures)
    is_scorer = any(name.endswith("ForSequenceClassification") for name in architectures)
    critic = load_pretrained(
        AutoModelForTokenClassification,
        path,
        dtype=dtype,
        device=device,
        gradient_checkpointing=gradient_checkpointing,
        trust_remote_code=trust_remote_code,
        config_updates=_CRITIC_CONFIG,
    )
    if is_scorer:  # the same ``score`` weight, loaded; the bias the scorer lacks starts at 0
        bias = value_head(critic).bias
        if bias is not None:
            with torch.no_grad():
                bias.zero_()
        log.info("critic from %s: the reward model's body and head", path)
    elif not is_critic:
        init_value_head(critic, head_std)
        log.info("critic from %s: body from the policy folder, value head initialised here", path)
    return critic


def critic_for(policy: PreTrainedModel, init_from: str | Path | None = None, lora: Any = None) -> nn.Module:
    """A run's critic, in training mode, on the policy's device and in its dtype: the policy's body
    with a zero head, or the folder ``init_from`` names (:func:`load_value_model`). With ``lora``
    (a ``LoraSection``: the critic trains through adapters) a light one: the policy's own base,
    shared, under the critic's adapters when the policy has adapters and no folder is named
    (``models/adapter_critic.py``); else that body, frozen, under adapters of its own."""
    if lora is not None and init_from is None and hasattr(policy, "get_base_model"):
        from posttrain.models.adapter_critic import AdapterCritic

        return AdapterCritic(policy, r=lora.r, alpha=lora.alpha).train()
    if init_from is None:
        critic = value_model_from_policy(policy)
    else:
        parameter = next(policy.parameters())
        critic = load_value_model(init_from, dtype=parameter.dtype, device=parameter.device)
    if lora is not None:  # its value head trains in full (peft's modules_to_save)
        from posttrain.models.lora import apply_lora

        critic = apply_lora(critic, r=lora.r, alpha=lora.alpha, target_modules=lora.target_modules)
    return critic.train()


def init_value_head(critic: PreTrainedModel, std: float = 0.0) -> None:
    """Zero the head (``std=0``) or draw it from N(0, std²); the bias starts at zero."""
    head = value_head(critic)
    with torch.no_grad():
        if std:
            head.weight.normal_(std=std)
        else:
            head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()


def value_head(critic: PreTrainedModel) -> nn.Linear:
    """The ``[hidden, 1]`` output layer (``score`` in Llama/Qwen2, ``classifier`` elsewhere)."""
    head = getattr(critic, "score", None) or getattr(critic, "classifier", None)
    if head is None:
        raise TypeError(f"{type(critic).__name__} has neither a score nor a classifier layer")
    return head


def values(critic: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, L]`` float32 value of every position; positions follow the attention mask like the
    policy's, so left-padded prompts get the same values as unpadded ones."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    return out.logits[..., 0].float()


def response_values(critic: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_start: int) -> Tensor:
    """``[B, T]`` values aligned with :func:`posttrain.models.logprobs.response_logprobs`.

    ``input_ids, attention_mask [B, P + T]`` with ``response_start = P``. Entry t is V(s_t), the
    value of the prefix that response token t is sampled from (read at position P − 1 + t), as
    GAE needs: δ_t = r_t + γ·V(s_{t+1}) − V(s_t).
    """
    if not 0 < response_start < input_ids.shape[1]:
        raise ValueError(f"response_start={response_start} must lie inside the sequence (1..{input_ids.shape[1] - 1})")
    return values(critic, input_ids, attention_mask)[:, response_start - 1 : -1]
