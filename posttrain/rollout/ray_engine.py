"""Rollout workers as Ray actors (``cluster.kind: ray``): one engine, many processes or machines.

:class:`RayEngine` is a :class:`~posttrain.rollout.types.RolloutEngine` like the local ones, so
the sources (single turn, environments, the asynchronous producer) and the loop run unchanged:
``generate`` splits the prompts into one contiguous share per worker (a prompt's samples stay on
one worker), each worker — a Ray actor holding its own copy of the policy and a local engine
(``rollout.engine``: native or transformers) — samples its share with a seed of its own, and
the shares come back as one :class:`Rollouts`, prompt-major, as one engine would return them.
``update_weights`` puts the policy's weights in Ray's object store once and every worker loads
them (the learner's new version, as verl and OpenRLHF broadcast after each step; through the
object store on the CPU and between GPUs alike: an NCCL broadcast group is not built).

The learner is this process (the driver); the reward functions' pooled calls run as Ray tasks
(``rewards/ray_pool.py``). Without ``cluster.address`` a local Ray cluster is started for the run and stopped
at its end; with one (``auto``, ``ray://host:10001``) a running cluster is joined and left
running. Under torchrun every learner process (a rank of ``strategy: ddp`` or ``fsdp2``) has workers
of its own, sampling its share of the step's prompts, on the cluster it joins or starts: on GPUs
start one (``ray start --head``) and give its address, so the ranks' workers share its devices.
A worker that dies (killed, out of memory, its node lost) is started again with the
current weights and its share sampled again; after ``cluster.max_worker_failures`` such deaths
the run stops with a message naming the worker. Ray is an optional extra: without it,
``cluster.kind: ray`` is refused before any model loads, with the install command.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from posttrain.config import ConfigError, Section
from posttrain.errors import PosttrainError
from posttrain.rollout.types import Rollouts, SamplingParams

INSTALL = "pip install 'posttrain[dist]' (or pip install ray)"
SEED_STRIDE = 7_919_317  # worker i samples with seed + i·stride: its own stream


class ClusterSection(Section):
    """Where rollouts are generated (``cluster`` in an RL config)."""

    kind: Literal["local", "ray"] = "local"
    """local: in this process (or the asynchronous producer's child process); ray: rollout
    workers as Ray actors (needs Ray: pip install 'posttrain[dist]')."""
    address: str | None = None
    """A running Ray cluster to join ("auto", "ray://host:10001", as for ray.init); null starts
    a local cluster for the run (for each learner process under torchrun) and stops it at the end."""
    rollout_workers: int = Field(2, ge=1)
    """How many rollout workers (actors), each with a copy of the policy and an engine (for each
    learner process under torchrun: each samples its own share of a step's prompts)."""
    worker_threads: int = Field(1, ge=1)
    """Torch threads (and Ray CPUs reserved) per worker."""
    worker_gpus: float = Field(0.0, ge=0)
    """GPUs per worker (0: the worker samples on the CPU; 1: a GPU of its own)."""
    max_worker_failures: int = Field(3, ge=0)
    """Deaths of rollout workers a run survives (each worker started again, its share sampled
    again); the next one stops the run, naming the worker."""


class RayWorkerError(PosttrainError, RuntimeError):
    """Rollout workers died more often than ``cluster.max_worker_failures`` allows."""


def import_ray() -> Any:
    """The ``ray`` module, or a one-line error with the install command."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"cluster.kind = 'ray' needs Ray, which is not installed: {INSTALL}") from None
    return ray


class RolloutWorker:
    """The actor: a local engine on its own copy of the policy (run by Ray in its process).
    ``interruptible``: its engine has a mailbox, and the actor runs two calls at once (Ray's
    threaded actor), so weights offered while a ``generate`` runs reach it at a token boundary."""

    def __init__(self, model: nn.Module, tokenizer: Any, kind: str, threads: int, version: int,
                 interruptible: bool = False, options: dict[str, Any] | None = None) -> None:  # fmt: skip
        from posttrain.rollout.engine import build_engine
        from posttrain.rollout.weight_mailbox import ThreadMailbox

        torch.set_num_threads(threads)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        mailbox = ThreadMailbox() if interruptible else None
        self.model = model.to(device)
        self.engine = build_engine(self.model, tokenizer, kind=kind, policy_version=version, mailbox=mailbox,
                                   **(options or {}))  # fmt: skip

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        return self.engine.generate(prompts, sampling)

    def update_weights(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """The learner's weights (by the policy's own names) into this worker's copy, then the engine
        refreshed from it as a colocated engine is (vLLM: its weights reloaded from the copy)."""
        self.model.load_state_dict(weights)
        self.engine.update_weights(version)

    def offer_weights(self, version: int, weights: Mapping[str, Tensor]) -> None:
        self.engine.offer_weights(version, weights)

    def pid(self) -> int:
        return os.getpid()


class RayEngine:
    """A rollout engine whose generation runs in ``cluster.rollout_workers`` Ray actors (see the
    module docstring). ``model`` is the policy (or the asynchronous producer's copy of it): its
    weights are what ``update_weights(version)`` sends when no ``state_dict`` is given.
    ``interruptible`` (``rollout.interrupt``): :meth:`offer_weights` reaches generations in flight.
    ``options``: build_engine's other arguments for each worker's engine (``kind: vllm``: a vLLM
    instance in each worker, started with ``options["vllm_options"]``)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        cluster: ClusterSection,
        kind: str = "auto",
        echo: Callable[[str], None] = print,
        interruptible: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.ray = ray = import_ray()
        self.model, self.tokenizer, self.cluster, self.kind, self.echo = model, tokenizer, cluster, kind, echo
        self.interruptible, self.offers, self.options = interruptible, [], options or {}
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        self.policy_version, self.failures = 0, 0
        self.started_cluster = not ray.is_initialized()
        if self.started_cluster:
            _connect(ray, cluster, sum(t.numel() * t.element_size() for t in model.state_dict().values()))
        # the policy's structure and first weights, shipped once; restarts build from them
        self.blob = ray.put(copy.deepcopy(model).to("cpu"))
        self.weights: Any = None  # the object-store copy of the newest weights, once sent
        self.actor_class = ray.remote(RolloutWorker)
        self.workers = [self._start(index) for index in range(cluster.rollout_workers)]

    # ------------------------------------------------------------------ the RolloutEngine protocol
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        """Each worker samples its contiguous share of ``prompts`` (``sampling.n`` each)."""
        shares = _split([list(p) for p in prompts], len(self.workers))
        calls = {i: self._sampling_of(i, sampling) for i, share in enumerate(shares) if share}
        pending = {i: self.workers[i].generate.remote(shares[i], calls[i]) for i in calls}
        results: dict[int, Rollouts] = {}
        for index in calls:
            results[index] = self._wait(
                index, pending[index], lambda i=index: self.workers[i].generate.remote(shares[i], calls[i])
            )
        rollouts = merge_rollouts([results[i] for i in sorted(results)], self.pad_id)
        if "token_versions" in rollouts.extras:  # the workers may have moved on to offered weights
            self.policy_version = max(self.policy_version, int(rollouts.extras["token_versions"].max()))
        return rollouts

    def offer_weights(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """Offer newer weights to every worker's generation in flight (taken at its next token
        boundary); not waited for: a worker that dies meanwhile restarts with the next update."""
        if not self.interruptible:
            raise RuntimeError("these rollout workers were started without interruptible=True")
        offered = self.ray.put({name: tensor.detach().to("cpu") for name, tensor in weights.items()})
        self.offers = [worker.offer_weights.remote(version, offered) for worker in self.workers]  # the last ones

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Put the new weights in the object store once; every worker loads them."""
        weights = state_dict if state_dict is not None else self.model.state_dict()
        self.weights = self.ray.put({name: tensor.detach().to("cpu") for name, tensor in weights.items()})
        self.policy_version = version
        pending = [worker.update_weights.remote(version, self.weights) for worker in self.workers]
        for index, ref in enumerate(pending):
            self._wait(index, ref, lambda: None)  # a worker that died is started with these weights

    def close(self) -> None:
        """Stop the workers, and the local cluster if this engine started it."""
        for worker in self.workers:
            self.ray.kill(worker)
        self.workers = []
        if self.started_cluster and self.ray.is_initialized():
            self.ray.shutdown()

    # ------------------------------------------------------------------ workers
    def _start(self, index: int) -> Any:
        """Start worker ``index`` on the shipped policy, with the newest weights sent."""
        cluster = self.cluster
        options = {"num_cpus": cluster.worker_threads, "num_gpus": cluster.worker_gpus, "max_restarts": 0}
        options["max_concurrency"] = 2 if self.interruptible else 1  # an offer beside a generation
        worker = self.actor_class.options(**options).remote(
            self.blob,
            self.tokenizer,
            self.kind,
            cluster.worker_threads,
            self.policy_version,
            self.interruptible,
            self.options,
        )
        if self.weights is not None:
            worker.update_weights.remote(self.policy_version, self.weights)
        return worker

    def _sampling_of(self, index: int, sampling: SamplingParams) -> SamplingParams:
        if sampling.seed is None:
            return sampling
        return dataclasses.replace(sampling, seed=(sampling.seed + index * SEED_STRIDE) % 2**62)

    def _wait(self, index: int, ref: Any, again: Callable[[], Any]) -> Any:
        """``ray.get(ref)``; a dead worker is started again and ``again()`` resubmits its call,
        until ``cluster.max_worker_failures`` deaths; an error raised in a worker is re-raised."""
        ray = self.ray
        while True:
            try:
                return ray.get(ref)
            except ray.exceptions.RayTaskError as error:  # the call itself raised: not a death
                raise error.as_instanceof_cause() from None
            except ray.exceptions.RayActorError as error:
                self.failures += 1
                limit = self.cluster.max_worker_failures
                cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                if self.failures > limit:
                    raise RayWorkerError(
                        f"rollout worker {index} died ({cause}); {self.failures} worker deaths in this run, more than "
                        f"cluster.max_worker_failures = {limit}: check the workers' memory and nodes (ray status), "
                        "then resume from the last checkpoint (resume=auto)"
                    ) from None
                self.echo(
                    f"[ray] rollout worker {index} died ({cause}); started again with policy version "
                    f"{self.policy_version} and its share sampled again ({self.failures} of at most {limit} deaths)"
                )
                self.workers[index] = self._start(index)
                ref = again()
                if ref is None:
                    return None


def _connect(ray: Any, cluster: ClusterSection, model_bytes: int) -> None:
    """Join ``cluster.address``, or start a local cluster with room for every worker and an
    object store for the policy's structure and two versions of its weights (and some slack)."""
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
    if cluster.address is not None:
        try:
            ray.init(address=cluster.address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise ConfigError(
                f"cluster.address = {cluster.address!r}: could not join a Ray cluster there ({error}); start one "
                "with `ray start --head`, or leave cluster.address out to start a local one for the run"
            ) from None
        return
    # the workers' reserved CPUs on top of the machine's: reward tasks (rewards/ray_pool.py) and
    # anything else the run places must still find a free one, or they would wait forever
    cpus = (os.cpu_count() or 1) + cluster.rollout_workers * cluster.worker_threads
    gpus = torch.cuda.device_count()
    store = max(256 << 20, 4 * model_bytes)
    ray.init(num_cpus=cpus, num_gpus=gpus, object_store_memory=store, **quiet)


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous shares, the first ``len % parts`` one longer."""
    size, extra = divmod(len(items), parts)
    shares, start = [], 0
    for index in range(parts):
        end = start + size + (index < extra)
        shares.append(items[start:end])
        start = end
    return shares


def merge_rollouts(parts: Sequence[Rollouts], pad_id: int) -> Rollouts:
    """The workers' :class:`Rollouts` as one, in order: prompts padded on the left and responses
    on the right to the widest part, group ids numbered on across the parts."""
    if len(parts) == 1:
        return parts[0]
    prompt_width = max(part.prompt_ids.shape[1] for part in parts)
    response_width = max(part.response_ids.shape[1] for part in parts)

    def pad(tensor: Tensor, width: int, value: float, left: bool = False) -> Tensor:
        filler = torch.full((tensor.shape[0], width - tensor.shape[1]), value, dtype=tensor.dtype)
        return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)

    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += int(part.group_ids.max()) + 1 if len(part) else 0
    return Rollouts(
        prompt_ids=torch.cat([pad(p.prompt_ids, prompt_width, pad_id, left=True) for p in parts]),
        prompt_mask=torch.cat([pad(p.prompt_mask, prompt_width, 0, left=True) for p in parts]),
        response_ids=torch.cat([pad(p.response_ids, response_width, pad_id) for p in parts]),
        response_mask=torch.cat([pad(p.response_mask, response_width, 0) for p in parts]),
        logprobs=torch.cat([pad(p.logprobs, response_width, 0) for p in parts]),
        finish_reasons=[reason for p in parts for reason in p.finish_reasons],
        group_ids=torch.cat([p.group_ids + offset for p, offset in zip(parts, offsets, strict=True)]),
        policy_version=torch.cat([p.policy_version for p in parts]),
        extras={key: _merged_extra([p.extras[key] for p in parts], [p.response_ids.shape[1] for p in parts],
                                   response_width) for key in set.intersection(*(set(p.extras) for p in parts))},
    )  # fmt: skip


def _merged_extra(tensors: list[Tensor], widths: list[int], response_width: int) -> Tensor:
    """The parts' values of one ``Rollouts.extras`` key as one: a per-token one ([B, T], e.g.
    ``token_versions``) right-padded with zeros to the widest response first (padding is never
    read); a per-token set ([B, T, K], ``sampling_mask``) with −1 to the widest response and set."""
    if all(t.dim() == 2 and t.shape[1] == w for t, w in zip(tensors, widths, strict=True)):
        tensors = [torch.nn.functional.pad(t, (0, response_width - t.shape[1])) for t in tensors]
    elif all(t.dim() == 3 and t.shape[1] == w for t, w in zip(tensors, widths, strict=True)):
        kept = max(t.shape[2] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, kept - t.shape[2], 0, response_width - t.shape[1]), value=-1)
                   for t in tensors]  # fmt: skip
    return torch.cat(tensors)
