"""Hub ids (``org/name``) as TRL users write them: resolved to a snapshot folder in the Hugging
Face cache, downloaded into it first when the Hub can be reached (``HF_HUB_OFFLINE=1`` keeps to
the cache). Models, tokenizers and datasets then load from that folder like any local one."""

from __future__ import annotations

import re
from pathlib import Path

# "gpt2", "Qwen/Qwen2.5-0.5B": what a Hub id looks like (a relative path can too: a local path wins)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text))


def hub_snapshot(repo_id: str, repo_type: str = "model") -> tuple[Path | None, str]:
    """The local snapshot folder of a Hub repository (from the cache, or downloaded into it), or
    None and why not."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type)), ""
    except Exception as error:  # offline, unknown repository, gated, no cache: the reason goes in the message
        return None, f"{type(error).__name__}: {str(error).splitlines()[0]}"
