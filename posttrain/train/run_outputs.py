"""Who writes a run's folder: one process, or under torchrun rank 0 alone (distributed.py).

The training loops (``offline.py``, ``rl.py``) call these unconditionally; on the other ranks
the sinks are silent and the writers return once rank 0 is done, so no loop carries a branch on
its rank. Every rank computes the same metrics; rank 0 logs them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from posttrain.distributed import world
from posttrain.rollout.batch import RolloutBatch
from posttrain.telemetry import MetricsLogger, Progress, write_failure_report, write_report
from posttrain.train.checkpoint import quiet_progress_bars, save_final
from posttrain.train.run_dir import prepare_run_dir


class Silent:
    """The logger and progress line of a rank that does not write (a null object)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        pass

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def ready_run_dir(
    out: Path, resume: str, overwrite: bool, config_yaml: str | None, echo: Callable[[str], None] = print
) -> Path | None:
    """Rank 0 makes the run folder ready (``run_dir.prepare_run_dir``); every rank gets the
    checkpoint to resume from (None for a fresh start)."""
    ranks = world()
    ready = prepare_run_dir(out, resume, overwrite, config_yaml, echo) if ranks.is_main else None
    return ranks.from_main(ready)


def run_sinks(
    out: Path,
    config: Any,
    start_step: int,
    progress_keys: Sequence[str],
    label: str,
    show_progress: bool = True,
) -> tuple[MetricsLogger | Silent, Progress | Silent]:
    """(the metrics logger, the progress line): rank 0's; silent ones elsewhere. ``config`` has
    ``steps``, ``log_every`` and what ``MetricsLogger.for_run`` reads."""
    if not world().is_main:
        return Silent(), Silent()
    logger = MetricsLogger.for_run(out, config, start_step)
    if not show_progress:
        return logger, Silent()
    return logger, Progress(config.steps, keys=progress_keys, every=config.log_every, label=label, start=start_step)


def on_main(write: Callable[[], None]) -> None:
    """Run ``write`` (a checkpoint, a file) on rank 0; no rank goes on before it is written."""
    ranks = world()
    if ranks.is_main:
        write()
    ranks.barrier()


def finish_run(out: Path, model: nn.Module, tokenizer: Any, title: str) -> None:
    """``final/`` and the report, written by rank 0; no rank leaves before they are. A sharded
    model's whole weights are gathered first (every rank takes part)."""
    weights = world().full_weights(model)

    def write() -> None:
        with quiet_progress_bars():
            save_final(model, out / "final", tokenizer, weights=weights)
        write_report(out, title=title)

    on_main(write)


def report_failure(out: Path, title: str, error: BaseException) -> None:
    """The failure report (what was logged up to the failure, and why), by rank 0; no collective:
    the other ranks may be gone."""
    if world().is_main:
        write_failure_report(out, title=title, error=error)


def logged_samples(batch: RolloutBatch, count: int) -> list[dict[str, Any]]:
    """The first ``count`` samples of a prepared batch as samples.jsonl records: prompt,
    completion, reward (None where unscored) and the sample's first-token advantage."""
    return [
        {
            "prompt": batch.prompts[i] if isinstance(batch.prompts[i], str) else str(batch.prompts[i]),
            "completion": batch.completions[i],
            "reward": None if math.isnan(float(batch.scores[i])) else float(batch.scores[i]),
            "advantage": float(batch.advantages[i][batch.response_mask[i].bool()][:1].sum()),
        }
        for i in range(min(count, len(batch)))
    ]
