"""Data parallel training under ``torchrun``: every use of ``torch.distributed`` in posttrain.

``torchrun --nproc_per_node N -m posttrain sft|rm|dpo ...`` runs N copies of the command with no
config change. Each process (a *rank*) holds the whole model; every step each takes its share of
the step's rows (the same seeded order on all ranks, cut into N contiguous parts), computes its
gradients, and the ranks sum them (one ``all_reduce``) before the identical optimizer step, so
the weights stay the same everywhere and equal a one-process run with the same global batch. The
loss of a micro-batch is normalised by the units (tokens, pairs) of the *whole* step across ranks,
which is what makes the summed gradient the one-process gradient. Rank 0 alone prepares the run
folder, logs, prints and writes checkpoints and the report; a resume loads the checkpoint on
every rank.

Backends: ``gloo`` on the CPU, ``nccl`` with CUDA (one GPU per rank: ``cuda:LOCAL_RANK``).
Outside torchrun (no ``WORLD_SIZE`` > 1) :func:`world` is a single process and every method here
does nothing, so the loops call them unconditionally. A command calls :func:`join` once its
device is known.

``strategy: fsdp2`` shards the weights, gradients and optimizer state over the ranks with
``fully_shard`` (each transformer block, then the whole model) instead of every rank holding
them all: the parameters become DTensors, every forward gathers a block's weights and
every backward reduce-scatters its gradients. The ranks still take equal shares of each step
(every forward and backward is a collective, so all ranks run the same number of them). A
checkpoint gathers the full weights and optimizer state to rank 0, which writes them as one
process would (a plain model folder; the optimizer state keyed by parameter name), and a resume
hands every rank its shards. In one process ``fsdp2`` has nothing to shard and changes nothing.
RL generates with a whole copy of the policy per rank (``rollout/gathered.py``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# torch.distributed.nn (imported by DTensor on first use) gives its functions the default
# ``group=group.WORLD``, evaluated at import: imported after init_process_group that default
# pins the group for the life of the process, so leave() could not free it. Imported here,
# before any group exists, the default is None.
import torch.distributed.nn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from posttrain.config import ConfigError
from posttrain.errors import PosttrainError

T = TypeVar("T")


class DistributedError(PosttrainError, ValueError):
    """A run cannot be split over the processes torchrun started; the message says why."""


class World:
    """This process's place among the ranks of a run (one process: rank 0 of 1)."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0) -> None:
        self.rank, self.size, self.local_rank = rank, size, local_rank

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run folder and prints."""
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """This rank's device: its own GPU (``cuda:LOCAL_RANK``) when the run names ``cuda``."""
        if self.size > 1 and device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    def share(self, items: Sequence[T], what: str = "batch_size") -> list[T]:
        """This rank's contiguous part of ``items`` (all ranks hold the same list)."""
        if len(items) % self.size:
            raise DistributedError(
                f"{what} ({len(items)}) must be a multiple of the number of processes ({self.size}) so that "
                f"each takes an equal share: set {what} to a multiple of {self.size}, or start {len(items)} "
                "processes or a divisor of it"
            )
        part = len(items) // self.size
        return list(items[self.rank * part : (self.rank + 1) * part])

    def split(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous part of ``items``, the first ``len % size`` ranks one item more
        (an uneven split: a minibatch's groups, which need not divide among the ranks)."""
        part, extra = divmod(len(items), self.size)
        start = self.rank * part + min(self.rank, extra)
        return list(items[start : start + part + (self.rank < extra)])

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` (a picklable object), in rank order, on every rank."""
        if self.size == 1:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def reduce_metrics(self, values: dict[str, float], *, summed: bool = False) -> dict[str, float]:
        """The ranks' metrics as one: a ``*_max`` key the largest, a ``*_min`` key the smallest,
        counts (``*_dropped``, ``*_groups``) and — with ``summed``, for partial sums such as an
        update's losses normalised by the whole step — every other key summed (a rank without
        the key adds 0); else the mean over the ranks that report the key (equal shares)."""
        if self.size == 1:
            return values
        reports = self.gather(values)
        merged: dict[str, float] = {}
        for key in sorted({key for report in reports for key in report}):
            present = [report[key] for report in reports if key in report]
            if key.endswith("_max"):
                merged[key] = max(present)
            elif key.endswith("_min"):
                merged[key] = min(present)
            elif summed or key.endswith(("_dropped", "_groups")):
                merged[key] = float(sum(present))
            else:
                merged[key] = float(sum(present)) / len(present)
        return merged

    def merged_states(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's entries for a per-rank ``state``: rank 0's at the top level (what one
        process saves) and, with several ranks, every rank's under ``"by_rank"``."""
        states = self.gather(state)
        return states[0] if self.size == 1 else {**states[0], "by_rank": states}

    def own_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of what :meth:`merged_states` saved (rank 0's for a rank the
        checkpoint did not have: a run resumed with more processes than it saved with)."""
        by_rank = saved.get("by_rank") or [saved]
        return by_rank[self.rank] if self.rank < len(by_rank) else by_rank[0]

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks."""
        if self.size == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (on the device the backend needs: NCCL takes CUDA tensors)."""
        if self.size == 1:
            return flag
        on_gpu = dist.get_backend() == "nccl"
        value = torch.tensor([int(flag)], device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each value averaged over the ranks (every rank passes the same keys)."""
        if self.size == 1 or not values:
            return values
        keys = sorted(values)
        stacked = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(stacked)
        return {key: float(v) / self.size for key, v in zip(keys, stacked, strict=True)}

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over the ranks (one flat all-reduce; a
        sharded model's backward already reduce-scattered the mean, scaled here to the sum)."""
        if self.size == 1:
            return
        if any(isinstance(p, DTensor) for p in params):
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(self.size)
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        for param, part in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            param.grad = part.view_as(param).to(param.dtype)

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a picklable object)."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def shard(self, model: Any, strategy: str) -> Any:
        """``model`` sharded with FSDP2 over the ranks (``strategy: fsdp2``): every transformer
        block (the classes the model names in ``_no_split_modules``), then the whole. One process,
        or ``ddp``: the model as it is."""
        if self.size == 1 or strategy != "fsdp2" or model is None or getattr(model, "replicated", False):
            return model  # a module declaring itself ``replicated`` (a light critic) stays whole
        from torch.distributed.fsdp import fully_shard

        kind = type(model).__name__
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module)
        # then each part of the model a caller may run on its own (a reward model's body and its
        # head, sequence_scores), unless it shares a weight with another part (tied embeddings);
        # with LoRA (peft) the parts of the transformers model inside the wrapper
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        owners: dict[int, set[str]] = {}
        for name, child in inner.named_children():
            for param in child.parameters():
                owners.setdefault(id(param), set()).add(name)
        for name, child in inner.named_children():
            params = list(child.parameters())
            if params and all(owners[id(param)] == {name} for param in params):
                fully_shard(child)
        fully_shard(model)
        held = sum(param.to_local().numel() for param in model.parameters())
        total = sum(param.numel() for param in model.parameters())
        print(f"[fsdp2] {kind} sharded over {self.size} processes: each holds {held:,} of its "
              f"{total:,} parameters (and their gradients and optimizer state)", flush=True)  # fmt: skip
        return model

    def full_weights(
        self, model: nn.Module, *, everywhere: bool = False, frozen: bool = True
    ) -> dict[str, Tensor] | None:
        """A sharded model's whole weights, on rank 0 (empty elsewhere; every rank calls it), or
        with ``everywhere`` on every rank; None for a model that is not sharded. Without
        ``frozen``: only the parameters that train (a LoRA checkpoint's adapters)."""
        if not is_sharded(model):
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere, ignore_frozen_params=not frozen)
        return get_model_state_dict(model, options=options)

    def load_weights(self, model: nn.Module, weights: dict[str, Tensor]) -> None:
        """``model.load_state_dict(weights)``; for a sharded model each rank takes its shards."""
        if is_sharded(model):
            load_full_weights(model, weights)
        else:
            model.load_state_dict(weights)

    def same_everywhere(self, value: int | None, key: str) -> None:
        """Refuse a setting the ranks hold differently (e.g. a derived ``micro_batch_tokens`` on
        machines with different memory): they would cut their passes differently."""
        if self.size == 1:
            return
        number = -1 if value is None else int(value)
        if self.most(number) != -self.most(-number):
            raise ConfigError(
                f"{key} differs between the processes (this one has {value}): set {key} in the config "
                "so that every process uses the same value"
            )

    def most(self, count: int) -> int:
        """The largest ``count`` over the ranks (how many passes each must run when every
        forward and backward of a sharded model is a collective)."""
        if self.size == 1:
            return count
        value = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state to checkpoint: its ``state_dict()``, or for a sharded model the
        whole state keyed by parameter name, on rank 0 (every rank calls it)."""
        if not is_sharded(model):
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {SHARDED_FORMAT: True, **get_optimizer_state_dict(model, optimizer, options=options)}

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore what :meth:`optimizer_state` saved, into a sharded model's optimizer or not."""
        saved_sharded = bool(state.get(SHARDED_FORMAT))
        if saved_sharded != is_sharded(model):
            raise DistributedError(
                "this checkpoint was saved with strategy "
                f"{'fsdp2' if saved_sharded else 'ddp (or one process)'} and is resumed with "
                f"{'fsdp2' if is_sharded(model) else 'ddp (or one process)'}: resume with the strategy and number "
                "of processes it was saved with (its final/ or step folder loads as model.path either way)"
            )
        if not saved_sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = {key: value for key, value in state.items() if key != SHARDED_FORMAT}
        # DCP builds the optimizer's (lazily created) state with a zero step, which it skips when a
        # parameter already holds a gradient (the RL update zeroes them from the start): not here
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        for param in params:
            param.grad = None
        set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad


SHARDED_FORMAT = "posttrain_fsdp2_full_state"  # marks an optimizer state saved from a sharded model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(isinstance(param, DTensor) for param in model.parameters())


def load_full_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Hand every rank its shards of ``weights`` (a whole state dict) in a sharded ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


_WORLD: World | None = None


def world() -> World:
    """The run's :class:`World` (a single process until :func:`join` was called under torchrun)."""
    return _WORLD if _WORLD is not None else World()


def join(device: torch.device) -> World:
    """Join torchrun's process group when this process is one of several (``WORLD_SIZE`` > 1):
    ``gloo`` for a CPU run, ``nccl`` for CUDA. Ranks other than 0 print nothing from here on
    (their stderr stays). Idempotent; returns :func:`world`."""
    global _WORLD
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if _WORLD is not None or size <= 1:
        return world()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    _WORLD = World(dist.get_rank(), dist.get_world_size(), local_rank)
    if not _WORLD.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    return _WORLD


def tell_torchrun(message: str) -> None:
    """Under torchrun, leave this process's error ``message`` where torchrun's failure summary reads
    it (``TORCHELASTIC_ERROR_FILE``), so the summary's root cause is the message, not a hint to
    decorate the entry point. torchrun's own traceback around that summary is printed by torchrun
    itself and cannot be suppressed from here."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = str(int(time.time()))
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": stamp}}}
    with contextlib.suppress(OSError):  # the message is on stderr already
        Path(path).write_text(json.dumps(record), encoding="utf-8")


def note_strategy(strategy: str) -> None:
    """Say on stderr that ``strategy: fsdp2`` in a single process shards nothing (torchrun was
    probably forgotten): the run goes on as one process, which is what it would compute anyway."""
    if strategy == "fsdp2" and world().size == 1:
        print(
            "[warning] strategy = 'fsdp2' in a single process: there is nothing to shard over, so this runs as one "
            "process holding the whole model. Start it with torchrun --nproc_per_node N -m posttrain ... to shard.",
            file=sys.stderr,
        )


def single_process_only(command: str) -> None:
    """Refuse to run ``command`` as one of several torchrun processes (it has no data parallel
    mode yet, and N copies would each write the same run folder)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        raise DistributedError(
            f"not a data parallel command yet, and torchrun started {size} processes (each would write the same "
            f"run folder): run it as one process (python -m posttrain {command} ..., or torchrun --nproc_per_node 1)"
        )


def _unpin_groups() -> None:
    """Let go of the process groups torch's caches still reach: DTensor's sharding and
    redistribution plans keep every device mesh an op ran on, and a mesh keeps its groups."""
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()  # private: read only while torch.compile traces


def leave() -> None:
    """Leave the process group (at the end of a command), freeing it and joining its threads.

    The command's objects are collected first: FSDP2's modules sit in reference cycles that hold
    the group, and a group freed only in the interpreter's finalization has its backend's
    threads still running there, which can abort the process at exit ("terminate called without
    an active exception"; pytorch/pytorch#179291)."""
    global _WORLD
    if dist.is_initialized():
        gc.collect()
        _unpin_groups()
        dist.destroy_process_group()
    _WORLD = None
