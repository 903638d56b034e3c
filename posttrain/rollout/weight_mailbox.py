"""Newer weights offered to a generation in flight (``rollout.interrupt``, docs/algorithms.md §8.2).

The asynchronous learner *posts* each new version of the trained weights here; the engine, at
every token boundary of a running ``generate``, asks whether a version newer than its own was
posted and, if so, copies it into its model (then it recomputes the KV cache: ``rollout/engine.py``).
Two mailboxes with one interface:

- :class:`ThreadMailbox` — the engine decodes in a thread of the learner's process: a post is one
  reference assignment to an immutable snapshot, read without a lock.
- :class:`SharedMailbox` — the engine decodes in a child process (``rollout/process_engine.py``):
  a staging copy of the offered tensors and a version counter, all in shared memory, and a
  process lock so the child never copies a half-written version. Its parameter names are fixed
  when it is made (the child receives it at start-up, and shared memory cannot grow later).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor, nn

NONE_POSTED = -1


class WeightMailbox(Protocol):
    def post(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """Offer ``weights`` (a subset of the model's parameters, by name) as ``version``."""
        ...

    def take_newer(self, version: int, model: nn.Module) -> int | None:
        """If a version newer than ``version`` was posted, copy it into ``model``'s parameters
        and return it; else None (and ``model`` is untouched)."""
        ...


class ThreadMailbox:
    """A mailbox between two threads of one process. The posted mapping must not change after
    the post (the learner's snapshots are fresh clones)."""

    def __init__(self) -> None:
        self.latest: tuple[int, Mapping[str, Tensor]] | None = None

    def post(self, version: int, weights: Mapping[str, Tensor]) -> None:
        self.latest = (version, weights)  # one assignment: the reader sees the old pair or the new

    def take_newer(self, version: int, model: nn.Module) -> int | None:
        latest = self.latest
        if latest is None or latest[0] <= version:
            return None
        posted, weights = latest
        _copy_into(model, weights)
        return posted


class SharedMailbox:
    """A mailbox between processes: staging tensors shaped like ``template`` in shared memory.

    Make it before the child starts and hand it to the child as a start-up argument (its lock
    can only be inherited)."""

    def __init__(self, template: Mapping[str, Tensor]) -> None:
        if not template:
            raise ValueError("a shared mailbox needs at least one tensor to stage")
        self.staging = {name: torch.empty_like(t, device="cpu").share_memory_() for name, t in template.items()}
        self.version = torch.full((1,), NONE_POSTED, dtype=torch.long).share_memory_()
        self.lock = torch.multiprocessing.get_context("spawn").Lock()

    def post(self, version: int, weights: Mapping[str, Tensor]) -> None:
        unknown = sorted(set(weights) - set(self.staging))
        if unknown:
            raise KeyError(f"the shared mailbox stages no tensor named {unknown[:3]} (it holds {len(self.staging)})")
        with self.lock, torch.no_grad():
            for name, tensor in weights.items():
                self.staging[name].copy_(tensor)
            self.version.fill_(version)

    def take_newer(self, version: int, model: nn.Module) -> int | None:
        if int(self.version) <= version:  # the common case, a read without the lock
            return None
        with self.lock:
            posted = int(self.version)
            _copy_into(model, self.staging)
        return posted


@torch.no_grad()
def _copy_into(model: nn.Module, weights: Mapping[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, tensor in weights.items():
        params[name].copy_(tensor)
