"""The sampling loop every local engine shares: prompts in, :class:`Rollouts` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from posttrain.rollout.hf import TransformersDecoder
from posttrain.rollout.native import NativeDecoder, unsupported_reason
from posttrain.rollout.sampling import choose_tokens
from posttrain.rollout.types import Rollouts, SamplingParams

ENGINE_KINDS = ("auto", "native", "transformers")


class Decoder(Protocol):
    def refresh(self) -> None: ...
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, repeats: int = 1) -> Tensor: ...
    def decode(self, tokens: Tensor) -> Tensor: ...


class LocalEngine:
    """Generates with a model in this process (colocated with the trainer or not).

    The model is held by reference: with ``update_weights(version)`` and no state dict the
    engine only refreshes what it derived from the weights (the native decoder also does
    this by itself when it sees an optimizer step changed them).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, decoder: Decoder, policy_version: int = 0) -> None:
        self.model, self.tokenizer, self.decoder = model, tokenizer, decoder
        self.policy_version = policy_version
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        if state_dict is not None:
            self.model.load_state_dict(state_dict)
        self.decoder.refresh()
        self.policy_version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, sampling)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        device = next(self.model.parameters()).device
        n = sampling.n
        group_ids = torch.arange(len(prompts)).repeat_interleave(n)
        width = max(len(p) for p in prompts)
        unique_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        unique_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            unique_ids[i, width - len(prompt) :] = torch.tensor(list(prompt))
            unique_mask[i, width - len(prompt) :] = 1
        # prompt-major rows: prompt i's n samples are rows i·n … i·n + n − 1
        prompt_ids, prompt_mask = unique_ids.repeat_interleave(n, 0), unique_mask.repeat_interleave(n, 0)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        stop_ids = torch.tensor(sorted({self.eos_id, *sampling.stop_token_ids} - {None}), dtype=torch.long)
        banned = self.pad_id if self.pad_id != self.eos_id else None

        batch, steps = len(prompts) * n, sampling.max_new_tokens
        tokens = torch.full((batch, steps), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((batch, steps), dtype=torch.float32)
        alive = torch.ones(batch, dtype=torch.bool)
        lengths = torch.zeros(batch, dtype=torch.long)
        stopped = torch.zeros(batch, dtype=torch.bool)
        texts = [""] * batch if sampling.stop_strings else None

        # each prompt is encoded once; the decoder copies its cache for the n samples
        logits = self.decoder.prefill(unique_ids.to(device), unique_mask.to(device), steps, repeats=n)
        for t in range(steps):
            chosen, chosen_logprobs = choose_tokens(
                logits,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                min_p=sampling.min_p,
                greedy=sampling.greedy,
                banned_token=banned,
                generator=generator,
            )
            chosen, chosen_logprobs = chosen.cpu(), chosen_logprobs.float().cpu()
            tokens[:, t] = torch.where(alive, chosen, self.pad_id)
            logprobs[:, t] = torch.where(alive, chosen_logprobs, 0.0)
            lengths += alive.long()
            ended = alive & torch.isin(chosen, stop_ids)
            if texts is not None:
                ended |= self._hit_stop_string(texts, chosen, alive, sampling.stop_strings)
            stopped |= ended
            alive &= ~ended
            if not alive.any() or t == steps - 1:
                break
            # finished rows keep decoding a pad token (cheaper than reshaping the batch);
            # their outputs are never read
            logits = self.decoder.decode(torch.where(alive, chosen, self.pad_id).to(device))

        width_out = int(lengths.max()) if batch else 0
        response_mask = (torch.arange(steps) < lengths.unsqueeze(-1)).float()[:, :width_out]
        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=tokens[:, :width_out],
            response_mask=response_mask,
            logprobs=logprobs[:, :width_out],
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
            group_ids=group_ids,
            policy_version=torch.full((batch,), self.policy_version, dtype=torch.long),
        )

    def _hit_stop_string(self, texts: list[str], chosen: Tensor, alive: Tensor, stop_strings: Sequence[str]) -> Tensor:
        """Extend each live row's text by its new token; True where a stop string now ends it."""
        longest = max(len(s) for s in stop_strings)
        hit = torch.zeros_like(alive)
        for i in torch.nonzero(alive).flatten().tolist():
            piece = self.tokenizer.decode([int(chosen[i])], skip_special_tokens=True)  # as vLLM matches
            texts[i] += piece
            # only the tail can contain a stop string that this token completed
            tail = texts[i][-(longest + len(piece)) :]
            hit[i] = any(s in tail for s in stop_strings)
        return hit


def build_engine(model: nn.Module, tokenizer: Any, kind: str = "auto", policy_version: int = 0) -> LocalEngine:
    """A local engine: ``native`` for Llama/Qwen2 weights, ``transformers`` for anything, ``auto``
    picks native when the model is supported."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown rollout engine {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
    reason = unsupported_reason(model)
    if kind == "native" and reason is not None:
        raise ValueError(f"rollout engine 'native' cannot run this model: {reason}; use 'transformers' or 'auto'")
    use_native = kind == "native" or (kind == "auto" and reason is None)
    decoder: Decoder = NativeDecoder(model) if use_native else TransformersDecoder(model)
    return LocalEngine(model, tokenizer, decoder, policy_version)
