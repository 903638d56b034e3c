"""vLLM generation that newer weights interrupt (``rollout.interrupt`` with ``rollout.engine: vllm``;
docs/algorithms.md §8.2).

vLLM cannot switch a request's weights between two of its tokens, so the switch is made the way
AReaL makes it with its inference servers (partial rollouts): between two engine steps, when the
mailbox holds a version newer than the engine's, every request in flight is aborted, the weights
are synced (which resets vLLM's prefix cache: no key or value computed by the old weights is
reused), and each unfinished sample is submitted again as its prompt plus the tokens it sampled so
far, for the tokens it has left. The local engine does the same inside one batch (it encodes each
running row again under the new weights, rollout/engine.py); the tokens are the same kind of
record either way: each carries the version that sampled it (``extras["token_versions"]``), and a
row's ``policy_version`` is its oldest.

Each sample is a request of its own (n = 1): vLLM fans ``n > 1`` out into child requests that
share one seed stream and are aborted together. A sample's seed is derived from the call's seed,
its row and how many times it was submitted, so a resubmitted sample does not replay the draws of
its first submission. Stop strings are found here, over each sample's whole response (as the
local engine finds them, rollout/stops.py): vLLM sees only the text of the current request, and
would miss a stop string that runs across the point where a sample was resubmitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from posttrain.rollout.stops import StopStrings
from posttrain.rollout.types import SamplingParams

if TYPE_CHECKING:
    from posttrain.rollout.vllm_engine import VLLMEngine

ROW_SEED_STRIDE, SUBMISSION_SEED_STRIDE = 104_729, 1_299_709  # primes: rows and resubmissions draw apart


@dataclass
class PartialSample:
    """One sample's response so far: its tokens, their log-probs and the versions that sampled them."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished
    submissions: int = 0


class InterruptibleGeneration:
    """The samples of one ``generate`` call, driven step by step through vLLM's engine so that a
    newer version offered meanwhile (``engine.mailbox``) can interrupt them between two steps."""

    def __init__(self, engine: VLLMEngine, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        self.engine, self.sampling = engine, sampling
        self.core = engine.llm.llm_engine
        self.samples = [PartialSample([int(t) for t in prompt]) for prompt in prompts for _ in range(sampling.n)]
        self.running: dict[str, int] = {}  # vLLM request id -> sample row
        self.stop_strings = (
            StopStrings(engine.tokenizer, sampling.stop_strings, len(self.samples)) if sampling.stop_strings else None
        )

    def run(self) -> list[PartialSample]:
        """Sample every row to its end; each finished sample has a ``finish_reason``."""
        self._take_newer()  # weights posted since the caller synced its own: start on them
        try:
            for row in range(len(self.samples)):
                self._submit(row)
            while self.running:
                if self._take_newer():
                    continue
                arrivals = self._step()
                self._end_on_stop_strings(arrivals)
        finally:
            if self.running:  # an error mid-way: leave no request of this call in the engine
                self.core.abort_request(list(self.running))
                self.running.clear()
        return self.samples

    def _take_newer(self) -> bool:
        """If a newer version was offered: abort what runs, sync vLLM to it, submit the unfinished
        samples again (the rest of their tokens under the new weights)."""
        engine = self.engine
        version = engine.mailbox.take_newer(engine.policy_version, engine.model)
        if version is None:
            return False
        interrupted = list(self.running.values())
        if self.running:  # vLLM resets its prefix cache only with no request running
            self.core.abort_request(list(self.running))
            self.running.clear()
        engine.update_weights(version)  # the mailbox copied the weights into engine.model
        for row in interrupted:
            self._submit(row)
        return True

    def _submit(self, row: int) -> None:
        sample, sampling = self.samples[row], self.sampling
        left = sampling.max_new_tokens - len(sample.tokens)
        if left <= 0:  # interrupted right after its last token: nothing left to sample
            sample.finish_reason = "length"
            return
        seed = None if sampling.seed is None else sampling.seed + ROW_SEED_STRIDE * row
        if seed is not None:
            seed += SUBMISSION_SEED_STRIDE * sample.submissions
        # stop strings are found here, over the whole response (the module's docstring says why)
        one = dataclasses.replace(sampling, n=1, max_new_tokens=left, seed=seed, stop_strings=())
        params = self.engine.sampling_params(one, index=0, delta=True)
        request = f"posttrain-{id(self)}-{row}-{sample.submissions}"
        sample.submissions += 1
        adapter = None if self.engine.adapters is None else self.engine.adapters.request
        prompt = {"prompt_token_ids": sample.prompt + sample.tokens}
        self.core.add_request(request, prompt, params, lora_request=adapter)
        self.running[request] = row

    def _step(self) -> dict[int, list[int]]:
        """One vLLM step; returns the tokens each sample received (row -> tokens)."""
        arrivals: dict[int, list[int]] = {}
        version = self.engine.policy_version
        for output in self.core.step():
            row = self.running.get(output.request_id)
            if row is None:  # a request this call aborted
                continue
            sample, completion = self.samples[row], output.outputs[0]
            tokens, steps = list(completion.token_ids), completion.logprobs  # this step's (DELTA outputs)
            if steps is None or len(steps) != len(tokens):
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0)")
            sample.tokens += tokens
            sample.logprobs += [step[t].logprob for step, t in zip(steps, tokens, strict=True)]
            sample.versions += [version] * len(tokens)
            arrivals[row] = tokens
            if output.finished:
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a request with finish reason {completion.finish_reason!r}")
                sample.finish_reason = completion.finish_reason
                del self.running[output.request_id]
        return arrivals

    def _end_on_stop_strings(self, arrivals: dict[int, list[int]]) -> None:
        """End each sample whose response now holds a stop string, after the token completing it."""
        if self.stop_strings is None or not arrivals:
            return
        hits: dict[int, int] = {}  # row -> how many of its new tokens it keeps
        for k in range(max(len(tokens) for tokens in arrivals.values())):
            rows = [row for row, tokens in arrivals.items() if len(tokens) > k and row not in hits]
            if not rows:
                break
            found = self.stop_strings.update(
                torch.tensor([arrivals[row][k] for row in rows]), torch.tensor(rows), torch.ones(len(rows), dtype=bool)
            )
            hits.update({row: k + 1 for row, hit in zip(rows, found.tolist(), strict=True) if hit})
        requests = {row: request for request, row in self.running.items()}
        for row, kept in hits.items():
            sample, extra = self.samples[row], len(arrivals[row]) - kept
            if extra:
                del sample.tokens[-extra:], sample.logprobs[-extra:], sample.versions[-extra:]
            sample.finish_reason = "stop"
            if row in requests:
                self.core.abort_request([requests[row]])
                del self.running[requests[row]]


def token_rows(samples: list[PartialSample]) -> list[tuple[list[int], list[float], str]]:
    """(tokens, log-probs, finish reason) of every sample, for the engine's assembly."""
    return [(s.tokens, s.logprobs, s.finish_reason or "length") for s in samples]


def token_versions(samples: list[PartialSample], width: int) -> Any:
    """``[B, width]`` long: the version that sampled each token (0 under padding, never read)."""
    versions = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        versions[row, : len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.long)
    return versions
