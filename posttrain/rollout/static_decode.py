"""Decoding over fixed shapes, each step replayed as one CUDA graph.

On a GPU a small model's decoding step is bound by launching its ~20 kernels per layer from
Python, not by the card (SmolLM2-135M: ~9 ms a step at any batch from 64 to 1024 on one H100,
where reading its weights takes ~0.1 ms). Here every tensor a step touches has a fixed address
and shape, so the whole step — the layers, sampling, the log-prob of the chosen token, the stop
check, writing the outputs — is captured once per batch *bucket* and then replayed with one
launch (``torch.cuda.CUDAGraph``; design notes: gpt-fast's static KV cache, nano-vllm's and
SGLang's per-batch-size graphs). Without CUDA (or with ``graphs=False``) the same step runs
eagerly, which is what the CPU tests compare against.

- **Compiled** (``compiled=True``, ``rollout.compile_step``): each layer runs as one function
  compiled by ``torch.compile`` (Inductor fuses the norms, rotations and activations into a few
  kernels), captured into the graph on a GPU, where it means fewer kernels in a graph. One compile
  serves every layer, bucket and span (dynamic sizes); the weights are inputs read where they
  are at each call, not constants, so an update or a rebound parameter is seen as eagerly.
  Sampling stays eager (it draws from the decoder's generator). Off by default: on a CPU it
  measured slower than the eager step (docs/scaling.md: the products dominate, and the guards
  checked at each call cost about what the fused ops save); its GPU figures are pending.

- **Static buffers**, allocated for up to R rows and C cache positions and kept across calls:
  the KV cache ``[layers, R, kv, C, D]`` (zeroed once, so unwritten positions are finite and
  masked), the attention bias, the per-row rotations, the next input token, each row's output
  row, a finished flag, and the output tokens, log-probs and stop hits ``[R + 1, C]`` (the last
  row catches the writes of padding rows). The step number is a device tensor: a replay needs
  nothing from the host.
- **Buckets**: a batch runs in the smallest power of two that holds it (at least 2), the rest
  padding rows that start finished. Every few steps (``check_every`` on a GPU, every step on the
  CPU, where a look costs nothing) the host looks at the finished flags: all done ends the batch;
  when the live rows fit a smaller bucket they are gathered to the front (cache included) and
  the smaller bucket's graph takes over, so a long tail does not run at full width.
- **Weights**: the decoder rewrites its derived weights in place (native.py), so an optimizer
  step or a sync is seen by the next replay. A graph is kept only while every tensor it reads
  is where it was at capture (:meth:`NativeDecoder.weight_pointers`); when one moved (a
  parameter rebound, adapters switched) every graph is dropped and captured again. A graph also
  belongs to one set of sampling rules (temperature, filters, stop ids).
- **Randomness**: a seeded call reseeds one generator kept for the decoder, registered with
  every graph, whose replays advance it as eager calls would; same seed, prompts, weights →
  same tokens, graphed or not.

- **Attention span**: a step attends to the cache positions written so far rounded up to a
  multiple of ``SPAN_STEP`` (the host knows the step, so each span is a graph of its own;
  ``UNGRAPHED_SPAN_STEP`` without graphs), not the whole capacity.
- **Stop strings** are decoded on the host at each look, for the steps since the last one; a
  row whose text ended is marked stopped at the step that completed the string.

- **Turns**: prompts may begin with rows a previous call kept (rollout/turn_cache.py): the
  prefill writes their keys and values and encodes the rest; with ``keep`` the rows' own are
  copied out when they leave the batch (a smaller bucket) and at its end — the bias tells a
  row's written positions from its padding.

Not taken here (the engine's step-by-step loop runs it): a generation that switches weights
mid-way (``rollout.interrupt``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.prefill_layout import reused_width
from posttrain.rollout.products import linear
from posttrain.rollout.sampling import Choice, choose_by
from posttrain.rollout.stops import StopStrings
from posttrain.rollout.turn_cache import KeptRows, Reuse
from posttrain.rollout.types import SamplingParams

CAPACITY_STEP = 128  # cache positions are allocated in multiples of this, so most batches fit the last size
SPAN_STEP = 64  # a step's attention reads the cache up to the next multiple of this (a graph per span)
# without graphs a span costs nothing to add (a compiled step takes any as one symbolic size), so spans are finer
UNGRAPHED_SPAN_STEP = 16
CHECK_EVERY = 8  # replays between two looks at the finished flags on a GPU (the overrun is at most this)


def bucket_for(rows: int) -> int:
    """The smallest power of two ≥ ``rows``, at least 2: a compiled step takes any width as one
    symbolic size but a size of 1 is always compiled apart, and a batch's sampled tokens depend
    on the widths it ran in (a padding row draws too), so eager, graphed and compiled steps
    share the buckets."""
    return max(2, 1 << max(0, rows - 1).bit_length())


@dataclass
class StepOutputs:
    """What a batch sampled, on the device: ``[B, steps]`` tokens, log-probs and stop hits."""

    tokens: Tensor
    logprobs: Tensor
    stops: Tensor


class StaticDecoding:
    """Samples batches for a :class:`NativeDecoder` with fixed-shape steps (see the module doc)."""

    def __init__(
        self,
        decoder: NativeDecoder,
        graphs: bool | None = None,
        check_every: int = CHECK_EVERY,
        compiled: bool = False,
    ) -> None:
        self.decoder = decoder
        self.device = decoder.embed.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.span_step = SPAN_STEP if self.graphs else UNGRAPHED_SPAN_STEP
        self._logits = _CompiledLogits() if compiled else _logits
        self.check_every = check_every if self.device.type == "cuda" else 1
        self.rows = self.capacity = 0
        self._captured: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pointers: tuple[int, ...] = ()
        self._pool = None
        self._stop_ids: dict[tuple[int, ...], Tensor] = {}  # a graph reads them where they are
        self.generator = torch.Generator(device=self.device)
        self.captures = 0  # graphs captured so far (a test and the benchmark read it)

    # ---- buffers -------------------------------------------------------------------------
    def _reserve(self, rows: int, capacity: int) -> None:
        """Buffers for ``rows`` rows and ``capacity`` positions; growing them drops every graph."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        self.release()
        d = self.decoder
        rows, capacity = max(rows, self.rows), -(-max(capacity, self.capacity) // CAPACITY_STEP) * CAPACITY_STEP
        dtype, device = d.embed.dtype, self.device
        shape = (len(d.layers), rows, d.kv_heads, capacity, d.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.bias = torch.zeros(rows, 1, 1, capacity, dtype=dtype, device=device)
        # real (cos, sin) pairs, not complex: a compiled step multiplies them out (rotary.py)
        self.rotations = torch.zeros(rows, capacity, 1, d.head_dim // 2, 2, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.out_row = torch.zeros(rows, dtype=torch.long, device=device)
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)
        self.out_tokens = torch.zeros(rows + 1, capacity, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(rows + 1, capacity, dtype=torch.float32, device=device)
        self.out_stops = torch.zeros(rows + 1, capacity, dtype=torch.bool, device=device)
        self.length = torch.zeros(1, dtype=torch.long, device=device)  # the prompts' cache width
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # the output column a step writes
        self.rows, self.capacity = rows, capacity

    def release(self) -> None:
        """Drop every graph and the large buffers (the next batch allocates and captures again)."""
        self._captured, self._pool, self._pointers = {}, None, ()
        self.keys = self.values = self.bias = self.rotations = None
        self.out_tokens = self.out_logprobs = self.out_stops = None
        self.rows = self.capacity = 0

    def _constant(self, stop_ids: Tensor | None) -> Tensor | None:
        """``stop_ids`` on the device, the same tensor for the same ids (graphs read its address)."""
        if stop_ids is None:
            return None
        key = tuple(stop_ids.tolist())
        if key not in self._stop_ids:
            self._stop_ids[key] = stop_ids.to(self.device)
        return self._stop_ids[key]

    # ---- one batch -----------------------------------------------------------------------
    @torch.inference_mode()
    def sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: SamplingParams,
        stop_ids: Tensor | None,
        banned: int | None,
        strings: StopStrings | None = None,
        reuse: Reuse | None = None,
        keep: KeptRows | None = None,
    ) -> StepOutputs:
        """Sample ``sampling.n`` responses per left-padded prompt; outputs ``[U·n, steps]``,
        cut where every row had stopped (rows run on after their stop; the caller cuts them).
        ``reuse``: kept keys and values the prompts begin with; ``keep``: where this batch's go."""
        d, batch = self.decoder, prompt_ids.shape[0] * sampling.n
        new = sampling.max_new_tokens
        length = prompt_ids.shape[1] if reuse is None else reused_width(prompt_mask, reuse.lengths)
        self._reserve(bucket_for(batch), length + new)
        generator = None if sampling.seed is None else self.generator.manual_seed(sampling.seed)
        rules = _Rules(sampling, self._constant(stop_ids), banned, generator)
        logits = d.prefill(
            prompt_ids.to(self.device), prompt_mask.to(self.device), new, sampling.n, (self.keys, self.values), reuse
        )
        self._start(batch, length, new)
        self._record(logits, batch, rules)  # the first token, from the prefill's logits
        width, steps, looked = bucket_for(batch), new, 0
        done = torch.zeros(batch, dtype=torch.bool)  # rows a stop string has ended (host side)
        for step in range(1, new):
            span = min(self.capacity, -(-(length + step) // self.span_step) * self.span_step)  # positions 0 … slot
            self._run(width, span, rules)
            if step < new - 1 and (step + 1) % self.check_every:
                continue
            if strings is not None:
                looked = self._look_for_strings(strings, done, looked, step + 1, width)
            if step == new - 1:
                break
            live = int((~self.finished[:width]).sum())  # the one host synchronisation per look
            if live == 0:
                steps = step + 1
                break
            if bucket_for(live) < width:
                if keep is not None:  # the rows about to be overwritten
                    self._keep(keep, torch.nonzero(self.finished[:width]).flatten())
                width = self._compact(width, bucket_for(live))
        if strings is not None and looked < steps:  # a batch of one step
            self._look_for_strings(strings, done, looked, steps, width)
        if keep is not None:
            self._keep(keep, torch.arange(width, device=self.device))
        return StepOutputs(
            self.out_tokens[:batch, :steps], self.out_logprobs[:batch, :steps], self.out_stops[:batch, :steps]
        )

    def _start(self, batch: int, length: int, new: int) -> None:
        """The buffers of a batch of ``batch`` rows whose prefill filled ``length`` positions."""
        d = self.decoder
        self.bias[:batch] = d.decode_bias
        self.bias[:batch, ..., length:] = torch.finfo(self.bias.dtype).min  # unmasked step by step
        self.rotations[:batch, :new] = torch.view_as_real(d.step_rotations)
        self.length.fill_(length)
        self.step.fill_(0)
        d.release(keep_weights=True)  # the prefill's own buffers; the cache is ours
        self.out_row.fill_(self.rows)  # padding rows write to the spare output row
        self.out_row[:batch] = torch.arange(batch, device=self.device)
        self.finished.fill_(True)
        self.finished[:batch] = False
        self.out_stops[:batch, :new] = False  # the last batch's stops must not cut this one

    def _keep(self, keep: KeptRows, rows: Tensor) -> None:
        """Copies of the keys and values of cache ``rows`` (padding rows skipped) for ``keep``:
        the positions each row attends to, the prompt's real tokens then those decoded."""
        decoded = int(self.step) - 1  # the last chosen token is not in the cache yet
        end = int(self.length) + decoded
        for row in rows.tolist():
            output = int(self.out_row[row])
            if output == self.rows:
                continue
            columns = torch.nonzero(self.bias[row, 0, 0, :end] == 0).flatten()
            keep.add(
                output,
                decoded,
                self.keys[:, row].index_select(2, columns),
                self.values[:, row].index_select(2, columns),
            )

    def _record(self, logits: Tensor, width: int, rules: _Rules) -> None:
        """Choose the next token of the first ``width`` rows from ``logits`` and write it out."""
        tokens, logprobs, _ = rules.choose(logits)
        flat = self.out_row[:width] * self.capacity + self.step
        self.out_tokens.view(-1).index_copy_(0, flat, tokens)
        self.out_logprobs.view(-1).index_copy_(0, flat, logprobs)
        if rules.stop_ids is not None:
            hit = (tokens[:, None] == rules.stop_ids).any(-1)
            self.out_stops.view(-1).index_copy_(0, flat, hit)
            self.finished[:width] |= hit
        self.tokens[:width] = tokens
        self.step += 1

    def _look_for_strings(self, strings: StopStrings, done: Tensor, start: int, end: int, width: int) -> int:
        """Mark where a stop string ended a row among output columns [start, end); returns end."""
        batch = done.shape[0]
        tokens, stops = self.out_tokens[:batch, start:end].cpu(), self.out_stops[:batch, start:end].cpu()
        first = strings.first_hits(tokens, ~done)
        ended = torch.nonzero(first >= 0).flatten()
        if len(ended):
            self.out_stops[ended.to(self.device), (first[ended] + start).to(self.device)] = True
        done |= (first >= 0) | stops.any(-1)  # a row a stop id ended needs no more decoding either
        flags = torch.zeros(self.rows + 1, dtype=torch.bool)
        flags[:batch] = done
        self.finished[:width] |= flags.to(self.device)[self.out_row[:width]]
        return end

    def _decode_step(self, width: int, span: int, rules: _Rules) -> None:
        """One whole step on the first ``width`` rows, attending to positions below ``span``:
        what a graph captures."""
        slot = self.length + self.step - 1  # the input token's cache position
        self.bias[:width].index_fill_(-1, slot, 0.0)
        rotations = self.rotations[:width].index_select(1, self.step - 1).squeeze(1)  # [width, 1, D/2, 2]
        keys, values = self.keys[:, :width].unbind(0), self.values[:, :width].unbind(0)  # a graph input each
        bias = self.bias[:width, ..., :span]
        logits = self._logits(self.decoder, self.tokens[:width], keys, values, bias, rotations, slot)
        self._record(logits, width, rules)

    def _run(self, width: int, span: int, rules: _Rules) -> None:
        if not self.graphs:
            self._decode_step(width, span, rules)
            return
        pointers = self.decoder.weight_pointers()
        if pointers != self._pointers:  # a weight moved: no captured step may read the old address
            self._captured, self._pool, self._pointers = {}, None, pointers
        key = (width, span, *rules.key)
        graph = self._captured.get(key)
        if graph is not None:
            graph.replay()
            return
        # this step runs eagerly (also warming up the kernels), then the next ones replay it
        self._decode_step(width, span, rules)
        graph = torch.cuda.CUDAGraph()
        if rules.generator is not None:
            graph.register_generator_state(rules.generator)
        # records the step without running it; thread-local: the learner may keep using the GPU
        # from its own thread meanwhile (an asynchronous producer's thread)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._decode_step(width, span, rules)
        self._pool = graph.pool()
        self._captured[key] = graph
        self.captures += 1

    def _compact(self, width: int, smaller: int) -> int:
        """Gather the live rows of the first ``width`` to the front; returns the new width."""
        live = torch.nonzero(~self.finished[:width]).flatten()
        n = live.numel()
        self.keys[:, :n] = self.keys[:, live]
        self.values[:, :n] = self.values[:, live]
        for buffer in (self.bias, self.rotations, self.tokens, self.out_row):
            buffer[:n] = buffer[live]
        self.out_row[n:smaller] = self.rows
        self.finished[:n] = False
        self.finished[n:smaller] = True
        return smaller


def _logits(decoder: NativeDecoder, *inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
    """A step's next-token logits (:meth:`NativeDecoder.decode_at` of ``inputs``), eagerly."""
    return decoder.decode_at(*inputs)


class _CompiledLogits:
    """The same with each layer compiled (:meth:`NativeDecoder.decode_layer`): one graph serves
    every layer, so the compile costs one layer's (a whole 30-layer forward unrolled took ~7
    minutes on 2 cores), for any batch width and attention span (dynamic sizes, without duck
    sizing, which would take two sizes that happen to be equal once, a width of 16 and a span of
    16, for one symbol and compile again when they part). The products are plain: Inductor
    chooses how to multiply (the decoder's packed or weight-major ones are for eager steps)."""

    def __init__(self) -> None:
        self.layer = torch.compile(NativeDecoder.decode_layer, dynamic=True, fullgraph=True)

    def __call__(self, decoder: NativeDecoder, *inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
        with fx_config.patch(use_duck_shape=False):
            return decoder.decode_at(*inputs, product=linear, layer=self.layer)


class _Rules:
    """One batch's sampling rules, as :func:`choose_tokens` takes them; ``key`` tells graphs apart."""

    def __init__(
        self, sampling: SamplingParams, stop_ids: Tensor | None, banned: int | None, generator: torch.Generator | None
    ) -> None:
        self.sampling, self.stop_ids, self.banned, self.generator = sampling, stop_ids, banned, generator
        s = sampling
        stops = () if stop_ids is None else tuple(stop_ids.tolist())
        self.key = (s.temperature, s.top_k, s.top_p, s.min_p, s.greedy, banned, stops, generator is not None)

    def choose(self, logits: Tensor) -> Choice:
        return choose_by(logits, self.sampling, self.banned, self.generator)
