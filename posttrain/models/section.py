"""The ``model:`` section every training command shares, and building what it describes: a
local folder or Hub id loaded, or a tiny model built here, with LoRA adapters where asked.
Checked before anything loads (``check_model_source``)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from posttrain.config import ConfigError, Section


class TinyModel(Section):
    """A tiny model built here with random weights (tests, demos, CPU benchmarks)."""

    arch: Literal["llama", "qwen2"] = "llama"
    """Model family of the config."""
    layers: int = Field(2, ge=1)
    """Decoder layers."""
    hidden: int = Field(128, ge=8)
    """Hidden size."""
    heads: int = Field(4, ge=1)
    """Attention heads."""
    intermediate: int | None = Field(None, ge=1)
    """MLP width (default 4 × hidden)."""
    tokenizer: Literal["char"] = "char"
    """The tokenizer built with it: one token per character."""
    max_positions: int = Field(2048, ge=16)
    """Context length (max_position_embeddings): prompt + completion tokens a row may have."""

    @model_validator(mode="after")
    def _head_shape(self) -> TinyModel:
        # each head takes hidden / heads channels, and rotary embeddings rotate them in pairs
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"model.tiny.hidden ({self.hidden}) must be divisible by model.tiny.heads ({self.heads}) "
                "into an even width per head (rotary embeddings rotate channel pairs)"
            )
        return self


class LoraSection(Section):
    r: int = Field(16, ge=1)
    """Adapter rank."""
    alpha: int = Field(32, ge=1)
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get adapters."""


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model folder, or a Hub id (org/name) found in the Hugging Face cache or
    downloaded into it. When set, `tiny` is ignored."""
    tiny: TinyModel | None = None
    """Build a tiny model from this spec instead of loading one."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype (a tiny model is built in float32, then cast)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (loaded and tiny models)."""
    lora: LoraSection | None = None
    """Train LoRA adapters instead of all weights (DPO then uses the adapter-free model as
    reference)."""

    @field_validator("path", mode="before")
    @classmethod
    def _a_folder_or_an_id(cls, value: Any) -> Any:
        # `model.path=hub:` or `path: org/name: x` is YAML for a mapping: say what a path looks like
        if isinstance(value, (dict, list)):
            raise ValueError(
                f"model.path is {value!r:.60}, not a path: give a local model folder (runs/sft/final) or a Hub id "
                "as org/name (HuggingFaceTB/SmolLM2-135M-Instruct); quote a value with ':' in it"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.path is None and self.tiny is None:
            raise ValueError("set model.path (a local model folder) or model.tiny (build a tiny model)")
        return self


def check_model_source(section: ModelSection) -> None:
    """A model folder that cannot load is refused here, before data is read or anything is
    built: its config.json is read (no weights), and the message names ``model.path``."""
    if section.path is None:
        return
    from posttrain.models.loading import ModelLoadError, read_config

    try:
        read_config(section.path)
    except ModelLoadError as error:
        raise ModelLoadError(f"model.path: {error}") from None


def vocab_size(section: ModelSection) -> int:
    """The model's vocabulary without loading it: its folder's config.json, or the character
    tokenizer's (a tiny model is built over it)."""
    if section.path is not None:
        from posttrain.models.loading import read_config

        return int(read_config(section.path).vocab_size)
    from posttrain.models.tokenizers import build_char_tokenizer

    return len(build_char_tokenizer())


def context_length(section: ModelSection) -> int | None:
    """The longest sequence the model's positions cover, without loading it: its config's
    ``max_position_embeddings`` (GPT-2's ``n_positions``), or the tiny model's; None if unsaid."""
    if section.path is None:
        return section.tiny.max_positions
    from posttrain.models.loading import read_config

    limit = getattr(read_config(section.path), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def build_model_and_tokenizer(section: ModelSection, seed: int) -> tuple[Any, Any]:
    from posttrain.models.loading import enable_checkpointing, load_causal_lm, load_tokenizer, resolve_dtype
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer

    if section.path is not None:
        model = load_causal_lm(section.path, dtype=section.dtype, gradient_checkpointing=section.gradient_checkpointing)
        tokenizer = load_tokenizer(section.path)
    else:
        spec = section.tiny
        tokenizer = build_char_tokenizer()
        model = build_tiny_causal_lm(
            len(tokenizer),
            arch=spec.arch,
            layers=spec.layers,
            hidden=spec.hidden,
            heads=spec.heads,
            intermediate=spec.intermediate,
            max_positions=spec.max_positions,
            seed=seed,
            tokenizer=tokenizer,
        )
        # the same two options a loaded model takes (load_causal_lm), so a tiny run can test them
        model = model.to(resolve_dtype(section.dtype))
        if section.gradient_checkpointing:
            enable_checkpointing(model)
    return with_lora(model, section), tokenizer


def with_lora(model: Any, section: ModelSection) -> Any:
    """``model`` wrapped with the adapters ``model.lora`` asks for (unchanged without it)."""
    if section.lora is None:
        return model
    from posttrain.models.lora import apply_lora

    lora = section.lora
    try:
        return apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)
    except ValueError as error:  # peft: no module matches target_modules
        layers = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.target_modules = {lora.target_modules!r} matches no layer of this model ({error}); "
            f"its linear layers: {', '.join(layers)}, or 'all-linear'"
        ) from None
