"""LoRA adapters through peft, with the reference policy for free.

With adapters, π_ref is the same module with the adapters switched off, so KL to the
reference and DPO's reference log-probs need no second copy of the model in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from peft import LoraConfig, PeftModel, get_peft_model


def apply_lora(
    model: Any,
    *,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "all-linear",
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters on ``target_modules``; only the adapters train."""
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


@contextlib.contextmanager
def reference_policy(model: Any) -> Iterator[Any]:
    """Inside this block ``model`` computes the reference policy: its adapters are disabled.

    For a model without adapters there is nothing to disable; the caller then needs a frozen
    copy instead, and this raises so that a KL to "the reference" never silently becomes a
    KL of the policy to itself.
    """
    if not isinstance(model, PeftModel):
        raise TypeError("reference_policy needs a LoRA (peft) model; without adapters keep a frozen copy")
    with model.disable_adapter():
        yield model


def merge_adapters(model: PeftModel) -> Any:
    """Fold the adapters into the base weights and return the plain transformers model (for
    a final folder any tool loads). In place: the peft wrapper must not be used afterwards."""
    return model.merge_and_unload()
