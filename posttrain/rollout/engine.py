"""The sampling loop every local engine shares: prompts in, :class:`Rollouts` out.

A *decoder* (the backend) only runs the model: ``prefill`` a batch of prompts, then
``decode`` one token per row, and ``select`` rows to drop finished ones. Everything else —
padding, groups of n, sampling rules, log-probs, stops, seeds, bookkeeping — lives here once,
so the native decoder and the transformers fallback give the same outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from posttrain.memory import return_free_memory
from posttrain.rollout.hf import TransformersDecoder
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.projections import unsupported_reason
from posttrain.rollout.sampling import SamplingWorkspace, choose_by
from posttrain.rollout.static_decode import StaticDecoding, StepOutputs
from posttrain.rollout.stops import StopStrings, stop_id_tensor
from posttrain.rollout.turn_cache import KeptRows
from posttrain.rollout.types import Rollouts, SamplingParams
from posttrain.rollout.weight_mailbox import WeightMailbox

if TYPE_CHECKING:
    from posttrain.rollout.vllm_engine import VLLMEngine, VLLMOptions

ENGINE_KINDS = ("auto", "native", "transformers", "vllm")
# per decoding step: the output rows that ran, their tokens, log-probs, stop hits, the weights
# version, the kept sets (None unless asked for)
Trace = tuple[list[Tensor], list[Tensor], list[Tensor], list["Tensor | None"], list[int], list["Tensor | None"]]
TRIM_FROM_BYTES = 64 << 20  # a released batch this large is handed back to the system


class Decoder(Protocol):
    """What the loop needs from a model backend. One batch at a time; ``prefill`` starts one."""

    def refresh(self) -> None:
        """Rebuild whatever was derived from the model's weights (fused matrices, ...)."""
        ...

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, repeats: int = 1) -> Tensor:
        """Encode left-padded prompts ``[U, P]``, each to be continued ``repeats`` times;
        return next-token logits ``[U·repeats, V]``, prompt-major."""
        ...

    def decode(self, tokens: Tensor) -> Tensor:
        """Append one token per running row ``[B]``; return next-token logits ``[B, V]``
        (which may live in a buffer the next ``decode`` call overwrites)."""
        ...

    def select(self, rows: Tensor) -> None:
        """Keep only the running rows ``rows [B']``, in that order."""
        ...

    def release(self) -> int:
        """Free what the batch held (caches, buffers, derived weights); the next ``prefill``
        rebuilds it. Returns about how many bytes were freed (0 when unknown)."""
        ...


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id lists → ``(ids [U, P], mask [U, P])`` long, left-padded with ``pad_id``."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt, and every prompt at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


class LocalEngine:
    """A :class:`~posttrain.rollout.types.RolloutEngine` running a model in this process.

    The model is held by reference: colocated with the trainer, ``update_weights(version)``
    only refreshes what the decoder derived from the weights (the native decoder also notices
    by itself when an optimizer step has changed them).

    With a ``mailbox`` (``rollout.interrupt``) a running ``generate`` switches to newer weights
    posted there at a token boundary: it copies them into the model and encodes every running
    row's prompt and tokens so far again under them — the KV cache of the old weights is
    dropped, never reused — then decodes on (docs/algorithms.md §8.2). Its rollouts then carry
    ``extras["token_versions"] [B, T]`` (the version that sampled each token) and, as
    ``policy_version``, the version they started with (the oldest in them).

    With ``static`` (a :class:`~posttrain.rollout.static_decode.StaticDecoding` over the native
    decoder: fixed-shape steps, replayed as CUDA graphs on a GPU) a batch is sampled by it,
    unless the engine has a mailbox or the batch asks for its sampling masks (kept sets of
    varying size per step): this loop then decodes step by step.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        decoder: Decoder,
        policy_version: int = 0,
        mailbox: WeightMailbox | None = None,
        static: StaticDecoding | None = None,
    ) -> None:
        self.model, self.tokenizer, self.decoder, self.static = model, tokenizer, decoder, static
        self.policy_version = policy_version
        self.mailbox = mailbox
        self.kept: KeptRows | None = None  # the last call's rows, when it asked to keep them
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Adopt new weights: copy ``state_dict`` into the model if given, then refresh."""
        if state_dict is not None:
            self.model.load_state_dict(state_dict)
        self.decoder.refresh()
        self.policy_version = version

    def offer_weights(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """Offer newer weights (parameters by name) to a ``generate`` in flight or the next one:
        taken at its next token boundary (``rollout.interrupt``; needs a mailbox)."""
        if self.mailbox is None:
            raise RuntimeError("this engine was built without a weight mailbox (build_engine(..., mailbox=...))")
        self.mailbox.post(version, weights)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        """Sample ``sampling.n`` responses per prompt (token ids, unpadded); B = len(prompts)·n rows."""
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)
        static = self.static is not None and self.mailbox is None and not sampling.sampling_mask
        was_training = self.model.training
        if was_training:  # eval() walks every submodule: skip it when there is nothing to switch
            self.model.eval()
        try:
            with torch.inference_mode():
                if static:
                    out = self._sample_fixed_shapes(prompt_ids, prompt_mask, sampling)
                else:
                    trace = self._sample(prompt_ids, prompt_mask, sampling)
        finally:
            # the cache and buffers would otherwise sit beside the trainer's update until the next
            # batch; handed back to the system only when large: a small batch's pages would just
            # be faulted in again by the next one (the RL step trims after its update anyway).
            # Fixed-shape decoding keeps its buffers and weights: its captured steps read them.
            if not static and self.decoder.release() >= TRIM_FROM_BYTES:
                return_free_memory()
            if was_training:
                self.model.train()
        # built outside inference mode: the trainer multiplies these with tensors that need grad
        if static:
            tokens, logprobs, stops = _outputs_from_device(out)
            versions = [self.policy_version] * tokens.shape[1]
        else:
            rows, step_tokens, step_logprobs, hits, versions, masks = trace
            batch = prompt_ids.shape[0] * sampling.n
            tokens, logprobs, stops = _scatter(self.pad_id, batch, rows, step_tokens, step_logprobs, hits)
        if self.kept is not None:
            self.kept.name_tokens(prompt_ids, prompt_mask, sampling.n, tokens)
        rollouts = self._assemble(prompt_ids, prompt_mask, sampling.n, tokens, logprobs, stops, versions)
        if not static and masks[0] is not None:
            width = rollouts.response_ids.shape[1]
            rollouts.extras["sampling_mask"] = _scatter_masks(len(rollouts), rows[:width], masks[:width], rollouts)
        return rollouts

    def _sample_fixed_shapes(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams) -> StepOutputs:
        """The batch sampled by fixed-shape steps (CUDA graphs on a GPU): ``[B, steps]`` outputs."""
        stop_ids = stop_id_tensor(self.eos_id, sampling.stop_token_ids)
        batch = prompt_ids.shape[0] * sampling.n
        strings = StopStrings(self.tokenizer, sampling.stop_strings, batch) if sampling.stop_strings else None
        reuse = self._reuse(prompt_ids, prompt_mask, sampling)
        self.kept = KeptRows((self.decoder.weights_mark(), self.policy_version)) if sampling.keep_cache else None
        return self.static.sample(
            prompt_ids, prompt_mask, sampling, stop_ids, self._banned_token(), strings, reuse=reuse, keep=self.kept
        )

    def _banned_token(self) -> int | None:
        """A sampled pad would read as padding: never choose it (unless it is also EOS)."""
        return self.pad_id if self.pad_id != self.eos_id else None

    def drop_kept(self) -> None:
        """Forget the rows the last call kept (the caller's episodes are over)."""
        self.kept = None

    def _sample(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams) -> Trace:
        """The decoding loop. Returns, per step, the batch rows that ran, their tokens,
        log-probs, stop hits (None when nothing can stop a response) and the weights version.

        With ``sampling.keep_cache`` every row's keys and values are kept for the next call
        (``self.kept``; a finished row's when it leaves the batch); rows the last call kept
        serve this one's prompts that begin with them (rollout/turn_cache.py)."""
        device = next(self.model.parameters()).device
        batch = prompt_ids.shape[0] * sampling.n
        generator = None if sampling.seed is None else torch.Generator(device=device).manual_seed(sampling.seed)
        stop_ids = stop_id_tensor(self.eos_id, sampling.stop_token_ids)
        stop_ids = None if stop_ids is None else stop_ids.to(device)
        strings = StopStrings(self.tokenizer, sampling.stop_strings, batch) if sampling.stop_strings else None
        banned = self._banned_token()
        rows = torch.arange(batch, device=device)  # the output row of each running row
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        trace: Trace = ([], [], [], [], [], [])
        workspace = SamplingWorkspace()

        if self.mailbox is not None:  # weights posted since the caller loaded its own
            self._take_newer_weights()
        reuse, self.kept = self._reuse(prompt_ids, prompt_mask, sampling), None
        logits = self.decoder.prefill(
            prompt_ids.to(device), prompt_mask.to(device), sampling.max_new_tokens, repeats=sampling.n,
            **({} if reuse is None else {"reuse": reuse}),
        )  # fmt: skip
        keeping = sampling.keep_cache and hasattr(self.decoder, "kept_rows")
        if keeping:
            self.kept = KeptRows((self.decoder.weights_mark(), self.policy_version))
        for t in range(sampling.max_new_tokens):
            tokens, logprobs, mask = choose_by(logits, sampling, banned, generator, workspace)
            hit = _stop_hits(tokens, rows, alive, stop_ids, strings)
            for column, value in zip(trace, (rows, tokens, logprobs, hit, self.policy_version, mask), strict=True):
                column.append(value)
            if t == sampling.max_new_tokens - 1:
                break
            if hit is not None:
                alive &= ~hit
                live = int(alive.sum())
                if live == 0:
                    break
                if live <= len(alive) // 2:
                    # drop finished rows once they are half the batch: decoding them is wasted work
                    keep = torch.nonzero(alive).flatten()
                    if keeping:
                        self._keep(torch.nonzero(~alive).flatten(), rows)
                    self.decoder.select(keep)
                    tokens, rows, alive = tokens[keep], rows[keep], alive[keep]
            if self.mailbox is not None and self._take_newer_weights():
                keeping, self.kept = False, None  # what was kept is the old weights'
                logits = self._encode_again(prompt_ids, prompt_mask, sampling, trace, rows)
            else:
                # a finished row that is still in the batch decodes on; its later tokens are masked
                logits = self.decoder.decode(tokens)
        if keeping:
            self._keep(torch.arange(len(rows), device=rows.device), rows)
        return trace

    def _reuse(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams) -> Any:
        """What the rows the last call kept spare this call's prompts, if they are still valid:
        computed by the weights sampling now, for prompts sampled once each."""
        kept = self.kept
        if kept is None or sampling.n != 1:
            return None
        mark, version = kept.weights
        if version != self.policy_version or not self.decoder.same_weights(mark):
            return None
        return kept.reuse_for(prompt_ids, prompt_mask)

    def _keep(self, running: Tensor, rows: Tensor) -> None:
        """Keep the keys and values of the cache rows ``running`` (output rows ``rows[running]``)."""
        fed = self.decoder.step  # tokens decoded so far: their keys and values are in the cache
        for row, (keys, values) in zip(rows[running].tolist(), self.decoder.kept_rows(running), strict=True):
            self.kept.add(row, fed, keys, values)

    def _take_newer_weights(self) -> bool:
        """Adopt the mailbox's weights if they are newer than the ones sampling now."""
        posted = self.mailbox.take_newer(self.policy_version, self.model)
        if posted is None:
            return False
        self.decoder.refresh()
        self.policy_version = posted
        return True

    def _encode_again(
        self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams, trace: Trace, rows: Tensor
    ) -> Tensor:
        """Next-token logits of the running ``rows`` under the model's (new) weights: a prefill of
        each row's prompt and the tokens it sampled so far (all rows have sampled as many), which
        replaces the cache built with the old weights."""
        steps, device = len(trace[1]), rows.device
        generated = torch.empty((prompt_ids.shape[0] * sampling.n, steps), dtype=torch.long, device=device)
        for step, (ran, tokens) in enumerate(zip(trace[0], trace[1], strict=True)):
            generated[ran, step] = tokens
        prompts = rows // sampling.n
        ids = torch.cat([prompt_ids.to(device)[prompts], generated[rows]], dim=1)
        mask = torch.cat([prompt_mask.to(device)[prompts], torch.ones_like(generated[rows])], dim=1)
        return self.decoder.prefill(ids, mask, sampling.max_new_tokens - steps)

    def _assemble(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        n: int,
        out_tokens: Tensor,
        out_logprobs: Tensor,
        stopped_at: Tensor,
        versions: list[int],
    ) -> Rollouts:
        """Rollouts from every row's sampled ``[B, steps]`` tokens, log-probs and stop hits: each
        row cut after its first stop."""
        batch, steps = out_tokens.shape
        stopped = stopped_at.any(-1)
        # argmax finds the first stop; the stop token itself belongs to the response
        lengths = torch.where(stopped, stopped_at.int().argmax(-1) + 1, steps)
        width = int(lengths.max())
        mask = torch.arange(width) < lengths[:, None]
        extras = {}
        if self.mailbox is not None:  # every row ran every step it has, so a step's version is its token's
            extras["token_versions"] = torch.tensor(versions[:width], dtype=torch.long).expand(batch, -1).clone()
        return Rollouts(
            prompt_ids=prompt_ids.repeat_interleave(n, 0),
            prompt_mask=prompt_mask.repeat_interleave(n, 0),
            response_ids=out_tokens[:, :width].masked_fill(~mask, self.pad_id),
            response_mask=mask.float(),
            logprobs=out_logprobs[:, :width].masked_fill(~mask, 0.0),
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
            group_ids=torch.arange(prompt_ids.shape[0]).repeat_interleave(n),
            policy_version=torch.full((batch,), versions[0], dtype=torch.long),
            extras=extras,
        )


def _scatter(
    pad_id: int, batch: int, rows: list[Tensor], tokens: list[Tensor], logprobs: list[Tensor], hits: list[Tensor | None]
) -> tuple[Tensor, Tensor, Tensor]:
    """The step-by-step trace as ``[B, steps]`` tokens, log-probs and stop hits on the CPU."""
    steps = len(tokens)
    out_tokens = torch.full((batch, steps), pad_id, dtype=torch.long)
    out_logprobs = torch.zeros((batch, steps), dtype=torch.float32)
    stopped_at = torch.zeros((batch, steps), dtype=torch.bool)
    start = 0
    for end in range(1, steps + 1):
        # steps between two drops of finished rows ran the same rows: scatter them at once
        if end < steps and rows[end] is rows[start]:
            continue
        index, columns = rows[start].cpu(), slice(start, end)
        out_tokens[index, columns] = torch.stack(tokens[columns], -1).cpu()
        out_logprobs[index, columns] = torch.stack(logprobs[columns], -1).float().cpu()
        if hits[start] is not None:
            stopped_at[index, columns] = torch.stack(hits[columns], -1).cpu()
        start = end
    return out_tokens, out_logprobs, stopped_at


def _scatter_masks(batch: int, rows: list[Tensor], masks: list[Tensor], rollouts: Rollouts) -> Tensor:
    """The steps' kept sets (``[rows, K_step]`` each) as one ``[B, T, K]`` int32 tensor, −1 padded,
    and −1 on every position past a response's end."""
    width = max(mask.shape[1] for mask in masks)
    out = torch.full((batch, len(masks), width), -1, dtype=torch.int32)
    for step, (ran, mask) in enumerate(zip(rows, masks, strict=True)):
        out[ran.cpu(), step, : mask.shape[1]] = mask.to(torch.int32).cpu()
    return out.masked_fill_(rollouts.response_mask[..., None] == 0, -1)


def _outputs_from_device(out: StepOutputs) -> tuple[Tensor, Tensor, Tensor]:
    """Fixed-shape decoding's outputs as ordinary CPU tensors (copies, outside inference mode)."""
    return tuple(torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in (out.tokens, out.logprobs, out.stops))


def _stop_hits(
    tokens: Tensor, rows: Tensor, alive: Tensor, stop_ids: Tensor | None, strings: StopStrings | None
) -> Tensor | None:
    """Which running rows' ``tokens`` end them (a stop id, or completing a stop string); None
    when nothing can stop a response."""
    if stop_ids is None and strings is None:
        return None
    hit = torch.isin(tokens, stop_ids) if stop_ids is not None else torch.zeros_like(alive)
    if strings is not None:
        hit |= strings.update(tokens, rows, alive)
    return hit & alive


def build_engine(
    model: nn.Module,
    tokenizer: Any,
    kind: str = "auto",
    policy_version: int = 0,
    vllm_options: VLLMOptions | None = None,
    mailbox: WeightMailbox | None = None,
    dtype: torch.dtype | None = None,
    cuda_graphs: bool = True,
    compile_step: bool = False,
) -> LocalEngine | VLLMEngine:
    """A rollout engine for ``model``: ``native`` for Llama/Qwen2 weights, ``transformers`` for any
    causal LM, ``auto`` picks native when the model is supported (all three a :class:`LocalEngine`);
    ``vllm`` a :class:`~posttrain.rollout.vllm_engine.VLLMEngine` started with ``vllm_options``
    (imported only then: vLLM is an optional extra). A ``mailbox`` makes generation interruptible
    by newer weights (:class:`LocalEngine`; vLLM's between two of its steps, vllm_interrupt.py).
    ``dtype``: on an accelerator the native decoder computes in copies of the weights in this
    dtype (bf16 over float32 masters; a CPU without fast bf16 products keeps the weights' own).
    ``cuda_graphs``: on a CUDA device the native decoder's steps are replayed as CUDA graphs
    (static_decode.py). ``compile_step``: the native decoder's steps run over fixed shapes, their
    layers compiled by ``torch.compile`` (any device; a one-time compile of several seconds)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown rollout engine {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
    if kind == "vllm":
        from posttrain.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, vllm_options, policy_version, mailbox)
    reason = unsupported_reason(model)
    if kind == "native" and reason is not None:
        raise ValueError(f"rollout engine 'native' cannot run this model: {reason}; use 'transformers' or 'auto'")
    use_native = kind == "native" or (kind == "auto" and reason is None)
    if not use_native:
        return LocalEngine(model, tokenizer, TransformersDecoder(model), policy_version, mailbox)
    device = next(model.parameters()).device
    decoder = NativeDecoder(model, dtype=None if device.type == "cpu" else dtype)
    graphed = cuda_graphs and device.type == "cuda"
    static = StaticDecoding(decoder, graphs=graphed, compiled=compile_step) if graphed or compile_step else None
    return LocalEngine(model, tokenizer, decoder, policy_version, mailbox, static)
