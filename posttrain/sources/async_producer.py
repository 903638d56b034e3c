"""Asynchronous RL: a producer thread samples and scores while the learner trains (seed 004, AReaL).

``rollout.max_staleness: η`` ≥ 1 wraps the run's source (single-turn or environment, built on a
rollout engine over *its own copy* of the policy, which by default decodes in a child process:
``rollout/process_engine.py``; ``train/rl_sources.py`` wires them) in :class:`AsyncProducer`. The
producer makes the batches in step order, each as soon as it is admitted, and the learner takes
batch k when it needs it; sampling never waits for the update, the update waits only for a batch not made yet.

Admission (docs/algorithms.md §8.1, AReaL's rule): batch k (1-based; trained by the update that
makes version k) may start once the learner has made version k − 1 − η, and it samples with
exactly the weights of version ``max(0, k − 1 − η)`` — so every consumed sample is at most η
versions old (the version at consumption is k − 1). AReaL samples with the newest weights at
hand instead; taking the admitted version itself costs no throughput (the producer would wait
for the same admission) and makes a run repeat exactly: the batches do not depend on how the
two threads happen to interleave, and a resumed run draws the batches a straight one draws.
The learner hands over a snapshot of its trainable weights after every update (only the
adapters with LoRA; under ``strategy: fsdp2`` gathered whole on every rank, whose producer samples
its own share of the groups); at most η + 1 snapshots are held at once.

Resume: ``state_dict()`` lets the producer finish every batch it may make before the learner's
next update (up to k + 1 + η after step k) and records the unconsumed ones with the inner
source's state; they were sampled with versions ≤ k, so nothing needs weights the checkpoint does
not hold. A checkpoint of a synchronous run resumed with η ≥ 1 starts from its own weights (the
versions before it are gone): the first η + 1 batches sample with the resumed version.

Interruptible generation (``rollout.interrupt``, §8.2): the learner also offers each new version
to the engine, which switches a generation in flight to it at the next token boundary (KV cache
recomputed); each batch starts with the newest version held, at least the admitted one. Every
token then carries the version that sampled it (``token_versions``) and a sample's
``policy_version`` is its oldest, so the admission bound still holds. Which token switches depends
on how the threads interleave: such a run does not repeat bit for bit, but a resume still does
(the recorded batches are the same either way).

Threads: the producer sets its own torch intra-op thread count (``rollout.producer_threads``,
default half of the run's threads), the learner keeps the rest for the run; torch's setting is
per thread. Errors in the producer (a broken reward function, an environment) are raised in the
learner at the step whose batch failed, after the earlier steps were trained and saved.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.distributed import world
from posttrain.rollout.batch import RolloutBatch
from posttrain.sources import RolloutSource

STATE_KEY = "async_producer"
STALENESS_BINS = 5  # async/staleness_k fractions logged for k = 0 .. 4; older samples in the last
JOIN_TIMEOUT_S = 120.0  # close() waits this long for a batch in flight before leaving it


def trainable_weights(model: nn.Module) -> dict[str, Tensor]:
    """``{name: detached clone}`` of the parameters training changes (all of them, or a LoRA
    policy's adapters): what a copy of the model built from the same start needs to catch up.
    Of a model holding FSDP2 shards, the whole tensors, gathered on every rank (each calls this)."""
    gathered = world().full_weights(model, everywhere=True, frozen=False)
    if gathered is not None:
        return {name: tensor.detach().clone() for name, tensor in gathered.items()}
    return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


def rollout_copy(policy: nn.Module) -> nn.Module:
    """A frozen copy of ``policy`` for the producer's engine (eval mode, no gradients)."""
    model = copy.deepcopy(policy).eval()
    return model.requires_grad_(False)


class AsyncProducer:
    """A :class:`~posttrain.sources.RolloutSource` that runs ``inner`` in a producer thread.

    ``inner`` must sample with an engine over ``rollout_model`` (a :func:`rollout_copy` of the
    policy), never the trained module itself; ``policy`` is the learner's model whose trainable
    weights are snapshotted at each :meth:`sync_weights`. See the module docstring."""

    def __init__(
        self,
        inner: RolloutSource,
        rollout_model: nn.Module,
        policy: nn.Module,
        *,
        max_staleness: int,
        steps: int,
        producer_threads: int = 1,
        engine: Any = None,
        interrupt: bool = False,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(
                f"max_staleness must be >= 1 for a producer (0 is the synchronous loop), got {max_staleness}"
            )
        self.inner, self.policy, self.engine = inner, policy, engine
        self.max_staleness, self.steps = max_staleness, steps
        self.interrupt = interrupt  # offer every version to the engine (it must have offer_weights)
        self.producer_threads = producer_threads
        self.rollout_params = dict(rollout_model.named_parameters())
        self.condition = threading.Condition()
        self.snapshots: dict[int, dict[str, Tensor]] = {}  # version -> trainable weights
        self.ready: dict[int, tuple[RolloutBatch, dict[str, float]]] = {}  # step -> made, not consumed
        self.next_step = 1  # the batch the producer makes next
        self.inner_state: dict[str, Any] | None = None  # the inner source's state before next_step
        self.learner_version = 0
        self.first_version: int | None = None  # the version the run started (or resumed) from
        self.learner_threads: int | None = None  # the learner's count before start(), restored by close()
        self.error: BaseException | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the RolloutSource protocol
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        t0 = time.perf_counter()
        with self.condition:
            self.condition.wait_for(lambda: step in self.ready or self.error is not None or not self._alive())
            if step not in self.ready:
                self._raise_producer_error(step)
            batch, metrics = self.ready.pop(step)
        metrics = {**metrics, **staleness_metrics(batch.policy_version, learner_version=step - 1)}
        if batch.token_versions is not None:
            metrics.update(token_version_metrics(batch.token_versions, batch.response_mask, learner_version=step - 1))
        metrics["time/learner_wait_s"] = time.perf_counter() - t0
        return batch, metrics

    def sync_weights(self, version: int) -> None:
        weights = trainable_weights(self.policy) if self._needed(version) else None
        with self.condition:
            if self.first_version is None:  # before start(): a resume hands over its checkpoint's version
                self.first_version = version
                self.next_step = max(self.next_step, version + 1)
            self.learner_version = version
            if weights is not None:
                self.snapshots[version] = weights
            self.condition.notify_all()
        if self.interrupt and weights is not None:  # outside the lock: a process engine copies it
            self.engine.offer_weights(version, weights)

    def state_dict(self) -> dict[str, Any]:
        """The inner source's state once every batch admissible before the next update is made,
        and those batches (see the module docstring). After a failed batch: the state before it,
        so a resumed run makes that batch again (the error itself is raised at its step)."""
        with self.condition:
            last = min(self.learner_version + 1 + self.max_staleness, self.steps)
            self.condition.wait_for(lambda: self.next_step > last or self.error is not None or not self._alive())
            ready = {step: (_batch_state(batch), metrics) for step, (batch, metrics) in self.ready.items()}
            inner = self.inner_state if self.inner_state is not None else self.inner.state_dict()
            return {**inner, STATE_KEY: {"ready": ready, "next_step": self.next_step}}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        missing = self.inner.load_state_dict(state)
        saved = state.get(STATE_KEY)
        if saved is not None:
            self.ready = {
                int(step): (RolloutBatch(**fields), metrics) for step, (fields, metrics) in saved["ready"].items()
            }
            self.next_step = int(saved["next_step"])
        return missing

    def start(self) -> None:
        self.inner.start()
        self.inner_state = copy.deepcopy(self.inner.state_dict())
        with self.condition:
            if self.first_version is None:  # a fresh run: version 0 is the policy as built
                self.first_version = 0
                self.snapshots[0] = trainable_weights(self.policy)
        total = torch.get_num_threads()
        self.learner_threads = total
        torch.set_num_threads(max(1, total - self.producer_threads))  # the learner's share, in its own thread
        self.thread = threading.Thread(
            target=self._produce, args=(self.producer_threads,), name="posttrain-producer", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        if self.thread is not None:
            self.thread.join(JOIN_TIMEOUT_S)
        if self.learner_threads is not None:
            torch.set_num_threads(self.learner_threads)
        if hasattr(self.engine, "close"):  # a rollout process
            self.engine.close()
        self.inner.close()

    # ------------------------------------------------------------------ the producer thread
    def _produce(self, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            while True:
                with self.condition:
                    step = self.next_step
                    if step > self.steps:
                        return
                    admitted = max(step - 1 - self.max_staleness, self.first_version or 0)
                    waited = time.perf_counter()
                    self.condition.wait_for(lambda v=admitted: self.stopping or self._held(v))
                    if self.stopping:
                        return
                    idle = time.perf_counter() - waited
                    # interruptible: start with the newest weights at hand (the run is timing-dependent
                    # anyway); the admitted version itself may be gone, dropped by an earlier batch
                    version = max(self.snapshots) if self.interrupt else admitted
                    weights = self.snapshots[version]
                    for older in [v for v in self.snapshots if v < version]:
                        del self.snapshots[older]
                self._load(weights)
                self.inner.sync_weights(version)  # the engine refreshes and stamps this version
                batch, metrics = self.inner.next_batch(step)
                metrics["time/producer_idle_s"] = idle
                inner_state = copy.deepcopy(self.inner.state_dict())  # taken here, where the source is idle
                with self.condition:
                    self.inner_state = inner_state
                    self.ready[step] = (batch, metrics)
                    self.next_step = step + 1
                    self.condition.notify_all()
        except BaseException as error:  # handed to the learner, raised at the step it belongs to
            with self.condition:
                self.error = error
                self.condition.notify_all()

    @torch.no_grad()
    def _load(self, weights: dict[str, Tensor]) -> None:
        for name, tensor in weights.items():
            self.rollout_params[name].copy_(tensor)

    # ------------------------------------------------------------------ helpers
    def _needed(self, version: int) -> bool:
        """Whether some batch will sample with ``version`` (the last η + 1 updates start none;
        interruptible, a batch in flight may switch to any version before the last update)."""
        if self.first_version is None:
            return True
        return version < self.steps if self.interrupt else version + 1 + self.max_staleness <= self.steps

    def _held(self, admitted: int) -> bool:
        """Whether batch weights are at hand: the admitted version, or (interruptible) any newer one."""
        if self.interrupt:
            return any(version >= admitted for version in self.snapshots)
        return admitted in self.snapshots

    def _alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _raise_producer_error(self, step: int) -> None:
        if self.error is not None:
            raise self.error
        raise RuntimeError(f"the rollout producer stopped before making the batch of step {step}")


def staleness_metrics(versions: Tensor, learner_version: int) -> dict[str, float]:
    """``async/staleness_mean``/``_max`` (learner version − the version that sampled, over the
    batch's samples) and ``async/staleness_k``: the fraction of samples k versions old, k = 0 ..
    STALENESS_BINS − 1 (the last bin holds every older sample too) — a histogram per step."""
    staleness = (learner_version - versions).clamp(min=0).float()
    metrics = {
        "async/staleness_mean": float(staleness.mean()) if staleness.numel() else 0.0,
        "async/staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
    }
    bins = staleness.long().clamp(max=STALENESS_BINS - 1)
    counts = torch.bincount(bins, minlength=STALENESS_BINS).float() / max(staleness.numel(), 1)
    metrics.update({f"async/staleness_{k}": float(counts[k]) for k in range(STALENESS_BINS)})
    return metrics


def token_version_metrics(token_versions: Tensor, mask: Tensor, learner_version: int) -> dict[str, float]:
    """With interruptible generation: ``async/versions_per_sample`` (distinct weight versions among
    a sample's tokens, averaged), ``async/interrupted_fraction`` (samples with more than one) and
    ``async/token_staleness_mean`` (learner version − the version that sampled, over tokens)."""
    kept = mask.bool()
    if not kept.any():
        return {"async/versions_per_sample": 0.0, "async/interrupted_fraction": 0.0, "async/token_staleness_mean": 0.0}
    counts = [len(set(row[row_kept].tolist())) for row, row_kept in zip(token_versions, kept, strict=True)]
    versions = torch.tensor([c for c in counts if c > 0], dtype=torch.float32)
    staleness = (learner_version - token_versions[kept]).clamp(min=0).float()
    return {
        "async/versions_per_sample": float(versions.mean()),
        "async/interrupted_fraction": float((versions > 1).float().mean()),
        "async/token_staleness_mean": float(staleness.mean()),
    }


def _batch_state(batch: RolloutBatch) -> dict[str, Any]:
    """A batch as plain fields (tensors, lists, dicts) for the checkpoint's training state."""
    return {item.name: getattr(batch, item.name) for item in dataclasses.fields(batch)}
