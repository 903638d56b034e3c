"""Running one pair of the combination matrix (tests/train/test_combination_matrix.py), in the test's
process or — for the pairs with fsdp2 — in each of two torchrun ranks, all such pairs in one launch:

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.train.matrix_pairs \
        RESULTS.jsonl WORK_DIR RAY_ADDRESS PAIR...

(PAIR as ``fsdp2×lora``; RAY_ADDRESS ``-`` for none). Rank 0 appends one line per pair to
RESULTS.jsonl: ``{"pair": ..., "failures": [each rank's failed check, or nothing]}``."""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

import torch

from posttrain.config import ConfigError
from posttrain.distributed import join, world
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

from .matrix_features import FEATURES, VLLM, Trace, base_overrides, local, write_rows

REFUSED = {
    frozenset({"replay", "max_staleness"}): "rollout.replay samples nothing",
    frozenset({"replay", "interrupt"}): "rollout.replay samples nothing",
    frozenset({"replay", "ray"}): "rollout.replay samples nothing",
}
"""The only pairs refused: replay samples nothing, so nothing overlaps sampling with training or
samples on Ray workers."""


def traced(overrides: list[str]) -> Trace:
    """Run ``overrides`` in this process, keeping every batch the update trained on and counting
    the generations of Ray's rollout workers and of vLLM (:class:`counted_generations`)."""
    config = load_rl_config(None, overrides)
    run = OnlineRL(config, echo=lambda line: None)
    batches, prepare = [], run.prepare

    def keep(batch, metrics):
        batches.append(batch)
        return prepare(batch, metrics)

    run.prepare = keep
    policy = {name: local(p) for name, p in run.policy.named_parameters()}
    critic = {} if run.critic is None else {name: local(p) for name, p in run.critic.named_parameters()}
    trace = Trace(run, [], batches, Path(config.output_dir), policy, critic)
    with counted_generations(trace):
        trace.history = run.run()
    return trace


class counted_generations:
    """Within the block, every :meth:`RayEngine.generate` adds one to ``trace.ray_generations`` and
    every :meth:`VLLMEngine.generate` of this process one to ``trace.vllm_generations``."""

    def __init__(self, trace: Trace) -> None:
        self.trace, self.patched = trace, []

    def __enter__(self) -> None:
        for module, name, counter in (
            ("posttrain.rollout.ray_engine", "RayEngine", "ray_generations"),
            ("posttrain.rollout.vllm_engine", "VLLMEngine", "vllm_generations"),
        ):
            try:
                engine_class = getattr(importlib.import_module(module), name)
            except ImportError:  # Ray or vLLM not installed: nothing of theirs runs
                continue
            self.patched.append((engine_class, engine_class.generate))
            engine_class.generate = self._counting(engine_class.generate, counter)

    def _counting(self, generate, counter: str):
        trace = self.trace

        def counting(engine, *args, **kwargs):
            setattr(trace, counter, getattr(trace, counter) + 1)
            return generate(engine, *args, **kwargs)

        return counting

    def __exit__(self, *exc) -> None:
        for engine_class, generate in self.patched:
            engine_class.generate = generate


def losses(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith(("loss/", "policy/grad_norm"))} for h in history]


def run_pair(pair: tuple[str, str], work: Path, ray_address: str | None = None) -> None:
    """Two steps of ``pair`` under ``work``, each feature's check passing (AssertionError if not);
    a refused pair refused before loading; a pair with replay recorded first, then replayed."""
    data = work / "rows.jsonl"
    if world().is_main:  # the ranks of a launch share ``work``
        work.mkdir(parents=True, exist_ok=True)
        write_rows(data)
    world().barrier()
    features = [{**FEATURES, "vllm": VLLM}[name] for name in pair]
    extra = [override for feature in features for override in feature.overrides]
    if "ray" in pair and ray_address is not None:
        extra.append(f"cluster.address={ray_address}")
    if frozenset(pair) in REFUSED:
        replay = [f"rollout.replay={work}"]
        try:
            load_rl_config(None, [*base_overrides(data, work / "run"), *extra, *replay])
        except ConfigError as error:
            assert REFUSED[frozenset(pair)] in str(error), str(error)
            return
        raise AssertionError(f"{pair} was not refused")
    if "replay" in pair:  # record the pair, then replay the recording with it
        recorded = traced([*base_overrides(data, work / "recorded"), *extra, "record_rollouts=true"])
        for feature in features:
            feature.check(recorded)
        replay = [f"rollout.replay={work / 'recorded' / 'rollouts'}"]
        replayed = traced([*base_overrides(data, work / "run"), *extra, *replay])
        assert losses(replayed.history) == losses(recorded.history)
        return
    trace = traced([*base_overrides(data, work / "run"), *extra])
    assert len(trace.history) == 2
    for feature in features:
        feature.check(trace)


def main(results: str, work: str, ray_address: str, *pairs: str) -> None:
    """Every pair in these processes (see the module docstring); a failed check is reported and the
    next pair runs, anything else stops the launch (a rank left in a collective would wait)."""
    torch.set_num_threads(1)
    ranks = join(torch.device("cpu"))
    for name in pairs:
        pair = tuple(name.split("×"))
        failure = ""
        try:
            run_pair(pair, Path(work) / name, None if ray_address == "-" else ray_address)
        except AssertionError:
            failure = f"rank {ranks.rank}: {traceback.format_exc()}"
        failures = [text for text in world().gather(failure) if text]
        if ranks.is_main:
            with open(results, "a", encoding="utf-8") as file:
                file.write(json.dumps({"pair": name, "failures": failures}) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
