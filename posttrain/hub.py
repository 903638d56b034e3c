"""Hub ids (``org/name``) as TRL users write them: resolved to a snapshot folder in the Hugging
Face cache, downloaded into it first when the Hub can be reached (``HF_HUB_OFFLINE=1`` keeps to
the cache). Models, tokenizers and datasets then load from that folder like any local one.

A typo is not a download: a missing local path that merely looks like ``org/name`` must not fetch
a stranger's model or dataset. So ``hub:org/name`` always names the Hub; a path that looks local
(starts with ``.``, ``/`` or ``~``, ends in a file extension, has no ``/``, or whose first folder
exists here: ``runs/final`` while ``runs/`` exists) never does; a bare ``org/name`` is tried on
the Hub only when nothing local matches, and says so on stderr first.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HUB_PREFIX = "hub:"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "Qwen/Qwen2.5-0.5B"
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # "gpt2", only with hub: in front
# what a file's name ends in; a Hub repository's name never does ("Qwen2.5-0.5B" ends in ".5B")
FILE_SUFFIXES = {
    ".json", ".jsonl", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".yaml", ".yml", ".gguf",
    ".safetensors", ".bin", ".pt", ".pth", ".zip", ".gz", ".tar",
}  # fmt: skip


def hub_repo_id(text: str) -> str | None:
    """The Hub repository ``text`` names, or None where it is a local path (see the module's rules)."""
    if text.startswith(HUB_PREFIX):
        repo_id = text[len(HUB_PREFIX) :]
        return repo_id if _REPO_ID.match(repo_id) or _NAME.match(repo_id) else None
    if text.startswith((".", "/", "~")) or Path(text).suffix.lower() in FILE_SUFFIXES:
        return None
    if not _REPO_ID.match(text) or Path(text.split("/")[0]).exists():
        return None
    return text


def is_hub_path(text: str) -> bool:
    return text.startswith(HUB_PREFIX)


def hub_snapshot(text: str, repo_type: str = "model") -> tuple[Path | None, str]:
    """The local snapshot folder of the Hub repository ``text`` names (``hub_repo_id``), from the
    cache or downloaded into it, or None and why not."""
    from huggingface_hub import snapshot_download

    repo_id = hub_repo_id(text)
    if repo_id is None:
        return None, f"{text!r} is not a Hub id (write hub:org/name)"
    if not is_hub_path(text):  # a bare org/name: say what is about to happen, as a typo could be one
        print(
            f"[hub] {text!r} is not a local path: looking for the Hugging Face Hub {repo_type} {repo_id} "
            f"(write hub:{repo_id} to say so, or ./{text} for a local folder)",
            file=sys.stderr,
        )
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type)), ""
    except Exception as error:  # offline, unknown repository, gated, no cache: the reason goes in the message
        return None, f"{type(error).__name__}: {str(error).splitlines()[0]}"
