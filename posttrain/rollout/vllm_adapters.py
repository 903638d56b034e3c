"""Adapter-only weight sync to vLLM for a LoRA policy (``rollout.vllm.weight_sync: auto``).

A LoRA policy's base weights never change in training, so vLLM is started once on the frozen base
(``enable_lora``) and after every update takes only the adapters, as a LoRA request: the adapter is
written as a peft folder (a few MB instead of the whole model), loaded under a new id per policy
version (``add_lora``) and the previous version's removed, so one adapter slot holds the live one.
vLLM loads adapters by path, as it does models; OpenRLHF and verl sync LoRA policies the same way.

The receipt: after loading, the engine's own list of loaded adapters (``list_loras``) must hold the
new version's id, or the sync failed — an ``add_lora`` that silently did nothing stops the run
instead of sampling with the previous adapter (``WeightSyncError``, rollout/vllm_engine.py).

Where vLLM cannot load the adapter as peft trains it — several adapters at once, a module trained
in full (``modules_to_save``), a rank above vLLM's largest — :func:`adapter_sync_reason` says why
and the engine sends the folded weights instead (rollout/weights.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from posttrain.rollout.projections import is_peft_model
from posttrain.rollout.weights import unmergeable_reason

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``max_lora_rank`` (vllm.config.lora.MaxLoRARanks)."""


def adapter_sync_reason(model: nn.Module) -> str | None:
    """Why ``model``'s adapters cannot go to vLLM alone (None when they can)."""
    if not is_peft_model(model):
        return "the policy has no LoRA adapters"
    reason = unmergeable_reason(model)
    if reason is not None:
        return reason
    if len(model.peft_config) != 1:
        return f"{len(model.peft_config)} adapters (vLLM serves one per request)"
    config = next(iter(model.peft_config.values()))
    if config.modules_to_save:
        return f"modules trained in full beside the adapter ({', '.join(sorted(config.modules_to_save))})"
    if config.r > MAX_LORA_RANKS[-1]:
        return f"LoRA rank {config.r} (vLLM serves ranks up to {MAX_LORA_RANKS[-1]})"
    return None


def base_weights_of(model: nn.Module) -> dict[str, Tensor]:
    """The frozen base weights of a LoRA policy under their checkpoint names (what vLLM starts on)."""
    base = model.get_base_model()
    return {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in base.state_dict().items()
        if ".lora_" not in name
    }


def lora_options(model: nn.Module) -> dict[str, Any]:
    """``vllm.LLM`` arguments that let it serve the policy's adapter: one slot, its rank rounded up
    to one vLLM takes."""
    rank = next(iter(model.peft_config.values())).r
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in MAX_LORA_RANKS if r >= rank)}


class AdapterSync:
    """The live adapter of one vLLM instance: :meth:`load` exports the policy's adapter as version
    ``version``'s folder, has vLLM load it, checks the receipt and drops the previous version."""

    def __init__(self) -> None:
        self.root = tempfile.TemporaryDirectory(prefix="posttrain-vllm-lora-")
        self.request: Any = None  # the LoRARequest every generate() passes

    def load(self, llm: Any, model: nn.Module, version: int) -> None:
        """Raises RuntimeError when vLLM did not take the adapter (the caller reports it)."""
        from vllm.lora.request import LoRARequest

        folder = Path(self.root.name) / f"version-{version}"
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)  # adapter_config.json and adapter_model.safetensors
        # load_inplace: a version synced again (a retried sync) is read again, not served from vLLM's cache
        request = LoRARequest(f"policy-v{version}", self._lora_id(version), str(folder), load_inplace=True)
        engine = llm.llm_engine
        engine.add_lora(request)
        if request.lora_int_id not in engine.list_loras():
            raise RuntimeError(f"vLLM's loaded adapters {sorted(engine.list_loras())} lack version {version}'s")
        previous, self.request = self.request, request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    @staticmethod
    def _lora_id(version: int) -> int:
        return version + 1  # vLLM's ids start at 1

    def close(self) -> None:
        self.root.cleanup()
