"""Load models and tokenizers from local folders, exactly as a user's downloaded checkpoint.

posttrain never reaches a model hub: every path is a local folder (``save_pretrained``
output, or a hub snapshot a user copied here). Errors say what was found and what to do,
instead of a network timeout deep inside transformers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model or tokenizer path that cannot be loaded; the message says why and what to do."""


def check_model_folder(path: str | Path) -> Path:
    """The folder as a Path, or an error naming what is missing."""
    folder = Path(path).expanduser()
    if not folder.exists():
        hint = " (posttrain loads local folders only; download the model first)" if "/" in str(path) else ""
        raise ModelLoadError(f"model path {path!r} does not exist{hint}")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {path!r} is a file; give the folder that holds config.json")
    if not (folder / "config.json").is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:10]) or "nothing"
        raise ModelLoadError(f"{folder} has no config.json (found: {found}); is it a Hugging Face model folder?")
    return folder


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> Any:
    """``AutoModelForCausalLM`` from a local folder, with a dtype, a device and optional
    gradient checkpointing (trades compute for activation memory on long sequences)."""
    folder = check_model_folder(path)
    if dtype not in (*DTYPES, "auto"):
        raise ModelLoadError(f"unknown dtype {dtype!r}; valid: {', '.join([*DTYPES, 'auto'])}")
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as error:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        raise ModelLoadError(
            f"{folder}: transformers cannot build model_type {model_type!r} ({error}); "
            "upgrade transformers or pass trust_remote_code if the model ships its own code"
        ) from None
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        config=config,
        dtype="auto" if dtype == "auto" else DTYPES[dtype],
        trust_remote_code=trust_remote_code,
        local_files_only=True,
    ).to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # a cache is useless (and warned about) while checkpointing
    return model


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local folder, guaranteed to have a pad token.

    Without one, EOS is reused as padding (what most RL stacks do): padding is always masked,
    and the rollout engine then lets EOS end responses without banning it.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"tokenizer path {path!r} is not a folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{folder} holds no loadable tokenizer ({error})") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"the tokenizer in {folder} has neither a pad nor an EOS token; add one")
        tokenizer.pad_token = tokenizer.eos_token
        log.info("tokenizer in %s has no pad token: using EOS (%r) for padding", folder, tokenizer.eos_token)
    return tokenizer
