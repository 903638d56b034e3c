"""A local engine in a child process: generation that does not share the trainer's interpreter.

The asynchronous producer (``sources/async_producer.py``) samples while the learner trains. In
one process both would take turns on Python's global interpreter lock, and a small model's
decoding loop is mostly Python between short kernels: measured on the demo's 547k-parameter
model (2 cores), a producer *thread* slowed the learner's update by 25–40% and gained nothing,
while two processes ran side by side at full speed. :class:`ProcessEngine` runs a
:class:`~posttrain.rollout.engine.LocalEngine` (native or transformers decoder) in a process
started with ``spawn`` (forking a process that runs torch threads is unsafe), with its own torch
thread count.

The model's tensors are moved to shared memory before the child starts, so the child decodes
with the same storage the parent holds: ``update_weights(version, state_dict)`` copies the new
weights in place in the parent (no transfer) and tells the child to rebuild what it derived from
them. The caller must not write the weights during a ``generate`` call (the producer loads a
version only between batches). Prompts, sampling parameters and the returned
:class:`~posttrain.rollout.types.Rollouts` travel through a pipe.

With ``interruptible`` parameter names (``rollout.interrupt``) the child's engine gets a
:class:`~posttrain.rollout.weight_mailbox.SharedMailbox`: ``offer_weights`` stages a newer
version of those parameters in shared memory from any thread of the parent, and the child takes
it at its next token boundary, mid-``generate``.

A child that raises hands the error back to the caller; a child that dies (killed, out of
memory) is reported with its exit code.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.errors import PosttrainError
from posttrain.rollout.types import Rollouts, SamplingParams
from posttrain.rollout.weight_mailbox import SharedMailbox


class RolloutProcessError(PosttrainError, RuntimeError):
    """The rollout process died or could not start; the message says how and what to do."""


class ProcessEngine:
    """A :class:`~posttrain.rollout.types.RolloutEngine` whose decoding runs in a child process.

    ``model`` is moved to shared memory (its tensors are the child's); ``kind`` is the engine
    kind (``auto``, ``native``, ``transformers``, or ``vllm``: its own vLLM instance in the child,
    given the weights at every ``update_weights``), ``options`` build_engine's others; ``threads``
    the child's torch threads; ``interruptible`` the parameters :meth:`offer_weights` may offer
    to a generation in flight (none: generation is never interrupted). The child starts at the
    first call, so a run that never samples starts none."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        kind: str = "auto",
        threads: int = 1,
        interruptible: Sequence[str] = (),
        options: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.kind, self.threads = model, tokenizer, kind, threads
        self.options = options or {}  # build_engine's other arguments (vLLM's options, ...)
        params = dict(model.named_parameters())
        self.mailbox = SharedMailbox({name: params[name] for name in interruptible}) if interruptible else None
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        self.policy_version = 0
        self.process: Any = None
        self.connection: Any = None

    # ------------------------------------------------------------------ the RolloutEngine protocol
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        rollouts = self._call("generate", [list(prompt) for prompt in prompts], sampling)
        if "token_versions" in rollouts.extras:  # the child may have moved on to offered weights
            self.policy_version = max(self.policy_version, int(rollouts.extras["token_versions"].max()))
        return rollouts

    def offer_weights(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """Stage newer weights for the child to take at its next token boundary (any thread)."""
        if self.mailbox is None:
            raise RuntimeError("this rollout process was started without interruptible parameters")
        self.mailbox.post(version, weights)

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Copy ``state_dict`` into the shared weights (if given), then let the child re-derive."""
        if state_dict is not None:
            with torch.no_grad():
                own = self.model.state_dict()
                for name, tensor in state_dict.items():
                    own[name].copy_(tensor)
        if self.process is not None:
            self._call("refresh", version)
        self.policy_version = version

    def close(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):  # a child already gone
            self.connection.send(("close", ()))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        self.process = self.connection = None

    # ------------------------------------------------------------------ the pipe
    def _start(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.model.share_memory()
        parent, child = context.Pipe()
        args = (child, self.model, self.tokenizer, self.kind, self.threads, self.policy_version, self.mailbox,
                self.options)  # fmt: skip
        self.process = context.Process(target=_serve, args=args, name="posttrain-rollout", daemon=True)
        try:
            self.process.start()
        except Exception as error:  # an object that cannot be pickled for the child
            self.process = None
            raise RolloutProcessError(
                f"could not start the rollout process ({type(error).__name__}: {error}); set "
                "rollout.producer: thread to sample in a thread of this process instead"
            ) from error
        child.close()
        self.connection = parent

    def _call(self, command: str, *args: Any) -> Any:
        if self.process is None:
            self._start()
        try:
            self.connection.send((command, args))
            status, value = self.connection.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as error:
            self.process.join(timeout=5)
            code = self.process.exitcode
            self.process = self.connection = None
            raise RolloutProcessError(
                f"the rollout process died (exit code {code}) during {command!r}; if it ran out of memory, lower "
                "prompts_per_step or samples_per_prompt, or set rollout.producer: thread"
            ) from error
        if status == "error":
            error, text = value
            raise error from RuntimeError(f"in the rollout process:\n{text}")
        return value


def _serve(
    connection: Any,
    model: nn.Module,
    tokenizer: Any,
    kind: str,
    threads: int,
    version: int,
    mailbox: SharedMailbox | None,
    options: dict[str, Any],
) -> None:
    """The child's loop: build the engine on the shared model, answer calls until told to close."""
    from posttrain.rollout.engine import build_engine

    # Ctrl-C reaches the whole process group: the parent stops the run and closes this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    engine = build_engine(model, tokenizer, kind=kind, policy_version=version, mailbox=mailbox, **options)
    while True:
        try:
            command, args = connection.recv()
        except EOFError:  # the parent is gone
            return
        if command == "close":
            if hasattr(engine, "close"):  # vLLM's instance and its exported folder
                engine.close()
            return
        try:
            if command == "generate":
                result: Any = engine.generate(*args)
            elif command == "refresh":
                engine.update_weights(*args)
                result = None
            else:
                raise ValueError(f"unknown command {command!r}")
            connection.send(("ok", result))
        except Exception as error:
            text = traceback.format_exc()
            try:
                connection.send(("error", (error, text)))
            except Exception:  # an exception that cannot be pickled: its type and message
                connection.send(("error", (RuntimeError(f"{type(error).__name__}: {error}"), text)))
