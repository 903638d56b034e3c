"""Load models and tokenizers from local folders, exactly as a user's downloaded checkpoint.

A path is a local folder (``save_pretrained`` output, or a Hub snapshot a user downloaded) or
a Hub id (``org/name``), which resolves to its snapshot in the Hugging Face cache, downloaded
into it first when the Hub can be reached. Every check runs before transformers is asked for
anything, so a wrong path gives a message that names the folder, what was found there and
what to do, instead of a network timeout or a traceback deep inside transformers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.errors import PosttrainError
from posttrain.hub import hub_repo_id, hub_snapshot

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DtypeName = Literal["float32", "bfloat16", "float16", "auto"]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
# "gpt2", "Qwen/Qwen2.5-0.5B": what a Hub id looks like (a relative path can too; the message covers both)


class ModelLoadError(PosttrainError, ValueError):
    """A model or tokenizer path that cannot be loaded; the message says why and what to do."""


def resolve_dtype(dtype: DtypeName | torch.dtype) -> torch.dtype | str:
    """``"bfloat16"`` → ``torch.bfloat16``; ``"auto"`` stays (the dtype saved in config.json)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; valid: {', '.join([*DTYPES, 'auto'])}")
    return DTYPES[dtype]


def existing_folder(path: str | Path, what: str = "model") -> Path:
    """``path`` as a local folder: the folder itself, or, for a Hub id (``org/name``) that is not a
    local path, its snapshot in the Hugging Face cache, downloaded first when the Hub can be
    reached (as ``from_pretrained`` does in TRL; ``HF_HUB_OFFLINE=1`` uses the cache only).
    Otherwise an error naming where it looked and what to do."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ModelLoadError(f"{what} path {str(path)!r} is a file; give the folder that holds config.json")
    message = f"{what} path {str(path)!r} does not exist (looked for {folder.resolve()})"
    if "runs" in folder.parts:  # a run's output, as the docs' commands chain them
        message += (
            ": it is what an earlier run writes, and that run has not run here (runs/demo/ is written by "
            "`make demo`; runs/NAME/final by a run with output_dir=runs/NAME)"
        )
    repo_id = hub_repo_id(str(path))
    if repo_id is not None:
        snapshot, reason = hub_snapshot(str(path))
        if snapshot is not None:
            return snapshot
        message += (
            f", and as a Hub id it is neither in the Hugging Face cache nor downloadable ({reason}). "
            f"Download it where there is network (`hf download {repo_id}`, into the cache, or with --local-dir "
            "DIR and pass DIR)"
        )
    raise ModelLoadError(message)


def check_model_folder(path: str | Path) -> Path:
    """The folder as a Path if it holds config.json; otherwise an error naming what is there."""
    folder = existing_folder(path)
    if (folder / "config.json").is_file():
        return folder
    if (folder / "adapter_config.json").is_file():
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise ModelLoadError(
            f"{folder} is a LoRA adapter (adapter_config.json, base model {base!r}), not a full model: "
            "load the base folder and add the adapter with peft.PeftModel.from_pretrained, or save "
            "a merged model (posttrain.models.lora.save_merged) and load that"
        )
    raise ModelLoadError(f"{folder} has no config.json (found: {_listing(folder)}); is it a Hugging Face model folder?")


def read_config(path: str | Path, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The folder's config (or a GGUF file's, from its metadata), or an error naming the
    model_type transformers does not know."""
    from posttrain.models.gguf import gguf_config, is_gguf_path

    if is_gguf_path(path):  # docs/real-models.md: a .gguf works wherever a folder does
        return gguf_config(path)
    folder = check_model_folder(path)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON ({error})") from None
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        if "auto_map" in raw and not trust_remote_code:
            hint = "the folder ships its own model code (auto_map): pass trust_remote_code=True if you trust it"
        else:
            hint = f"transformers {transformers.__version__} does not know it; upgrade transformers or fix config.json"
        raise ModelLoadError(
            f"{folder}: unknown architecture, config.json has model_type {raw.get('model_type')!r} "
            f"and architectures {raw.get('architectures')}; {hint} ({error})"
        ) from None


def load_pretrained(
    auto_class: Any,
    path: str | Path,
    *,
    dtype: DtypeName | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    config_updates: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """``auto_class.from_pretrained`` on a local folder, after checks with actionable errors.

    ``config_updates`` are set on the config first (``num_labels=1`` turns a policy folder into
    a critic or a scorer). Gradient checkpointing trades compute for activation memory on long
    sequences (:func:`enable_checkpointing`).
    """
    folder = check_model_folder(path)
    torch_dtype = resolve_dtype(dtype)
    config = read_config(folder, trust_remote_code=trust_remote_code)
    for key, value in (config_updates or {}).items():
        setattr(config, key, value)
    _check_architecture(folder, config, auto_class, trust_remote_code)
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir()):
        raise ModelLoadError(
            f"{folder} has config.json but no weights (*.safetensors or *.bin; found: {_listing(folder)})"
        )
    try:
        with quiet_progress_bars():
            model = auto_class.from_pretrained(
                folder, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code, local_files_only=True
            )
    except OSError as error:
        raise ModelLoadError(f"{folder}: transformers could not read the weights ({error})") from None
    model.to(device)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar for every one-shard save and load; in a training log
    they are noise between the lines that matter."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in the backward pass instead of storing them.

    Non-reentrant, so it also works when the inputs need no gradient (frozen embeddings under
    LoRA). transformers 5 renamed ``gradient_checkpointing_enable``; both names are handled.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # a cache is useless (and warned about) while checkpointing


def load_causal_lm(
    path: str | Path,
    *,
    dtype: DtypeName | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """``AutoModelForCausalLM`` from a local folder, in ``dtype`` on ``device`` (eval mode, as
    transformers returns it). ``dtype="auto"`` keeps the dtype saved in config.json.

    A ``.gguf`` file works too (needs the ``gguf`` package): its weights are dequantised into a
    plain model of the same architecture (``posttrain.models.gguf``)."""
    from posttrain.models.gguf import is_gguf_path, load_gguf_causal_lm

    if is_gguf_path(path):
        resolved = resolve_dtype(dtype)
        model = load_gguf_causal_lm(path, dtype=torch.float32 if resolved == "auto" else resolved).to(device)
        if gradient_checkpointing:
            enable_checkpointing(model)
        return model
    return load_pretrained(
        AutoModelForCausalLM,
        path,
        dtype=dtype,
        device=device,
        gradient_checkpointing=gradient_checkpointing,
        trust_remote_code=trust_remote_code,
    )


def load_tokenizer(
    path: str | Path,
    *,
    padding_side: Literal["left", "right"] | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """The tokenizer of a local folder, guaranteed to have a pad token (see :func:`ensure_pad_token`).

    ``padding_side`` only matters when you call ``tokenizer(texts, padding=True)`` yourself
    (posttrain's collators and rollout engines pad explicitly). Use ``"left"`` for prompts of
    batched generation, so every row's last prompt token sits in the last column and new
    tokens append after it; use ``"right"`` for training and scoring batches (SFT, log-prob
    passes, reward models), where real tokens keep positions 0…n-1. ``None`` keeps the
    folder's own setting.
    """
    from posttrain.models.gguf import is_gguf_path, load_gguf_tokenizer

    if padding_side not in (None, "left", "right"):
        raise ModelLoadError(f"padding_side must be 'left', 'right' or None, not {padding_side!r}")
    if is_gguf_path(path):  # the tokenizer and chat template stored in the GGUF file
        tokenizer = load_gguf_tokenizer(path)
        if padding_side is not None:
            tokenizer.padding_side = padding_side
        return ensure_pad_token(tokenizer, source=str(path))
    folder = existing_folder(path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(
            f"{folder} holds no tokenizer transformers can load (found: {_listing(folder)}); "
            f"expected tokenizer.json or tokenizer_config.json ({str(error).splitlines()[0]})"
        ) from None
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return ensure_pad_token(tokenizer, source=str(folder))


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, source: str = "tokenizer") -> PreTrainedTokenizerBase:
    """Give a tokenizer without a pad token its EOS as pad (what most RL stacks do), in place.

    Padding is always masked, so sharing the id is harmless as long as masks come from
    attention masks or lengths, never from ``ids != pad_id`` (that would also mask the real
    EOS a response ends with). A tokenizer with neither pad nor EOS is an error.
    """
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ModelLoadError(
            f"{source}: the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token "
            "(adding a new token also needs model.resize_token_embeddings)"
        )
    tokenizer.pad_token = tokenizer.eos_token
    log.warning(
        "%s: the tokenizer has no pad token; using EOS %r (id %d) for padding",
        source,
        tokenizer.eos_token,
        tokenizer.eos_token_id,
    )
    return tokenizer


def _check_architecture(folder: Path, config: PretrainedConfig, auto_class: Any, trust_remote_code: bool) -> None:
    """An error naming the architecture when ``auto_class`` has no class for this config."""
    if trust_remote_code and auto_class.__name__ in (getattr(config, "auto_map", None) or {}):
        return  # the folder's own code provides the class
    mapping = getattr(auto_class, "_model_mapping", None)  # private, but stable across 4.x and 5.x
    if mapping is None or type(config) in mapping:
        return
    raise ModelLoadError(
        f"{folder}: unknown architecture for {auto_class.__name__}: model_type {config.model_type!r} "
        f"(architectures {getattr(config, 'architectures', None)}) has no such class in transformers "
        f"{transformers.__version__}; posttrain trains decoder-only models (Llama, Qwen2, Mistral, ...)"
    )


def _listing(folder: Path, limit: int = 10) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "nothing"
