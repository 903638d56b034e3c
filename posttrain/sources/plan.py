"""What every sampling source reads of a run's config, as one value the wiring makes from it.

A source takes the config sections it reads (``data:``, ``env:``) and this plan, never the whole
run config: the sources sit on a floor below the loop (``train/``), which builds the plan in
``train/rl_sources.py``."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.rollout.types import SamplingParams


@dataclass(frozen=True)
class SamplingPlan:
    """How a step's samples are drawn: ``prompts_per_step`` rows, ``samples_per_prompt``
    completions (or episodes) of each, sampled at ``temperature``/``top_p``/``top_k`` up to
    ``max_new_tokens`` per turn, ended by ``stop``; ``seed`` makes every draw repeatable.
    ``eval_k`` and ``eval_batch_size`` shape held-out evaluation (``RLRun``'s fields);
    ``sampling_mask``: training draws return each token's kept set (``rollout.keep_sampling_mask``)."""

    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int = 0
    eval_k: int = 0
    eval_batch_size: int = 256
    sampling_mask: bool = False

    def params(
        self,
        *,
        seed: int,
        n: int = 1,
        max_new_tokens: int | None = None,
        greedy: bool = False,
        keep_cache: bool = False,
    ) -> SamplingParams:
        """The engine's sampling parameters of one call (the plan's temperature, truncation and stops)."""
        return SamplingParams(
            n=n,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            greedy=greedy,
            stop_strings=self.stop,
            seed=seed,
            sampling_mask=self.sampling_mask and not greedy,
            keep_cache=keep_cache,
        )


def sample_seed(seed: int, step: int, round_index: int = 0, rank: int = 0, turn: int = 0) -> int:
    """The seed of one generation call, from (run seed, step, round, rank, turn): a resumed run
    samples exactly the tokens a straight one samples. (The strides are the ones runs have always
    used: recorded runs repeat.)"""
    return (seed * 1_000_003 + step * 1009 + round_index + turn * 7919 + rank * 7_919_317) % 2**62
