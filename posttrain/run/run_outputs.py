"""Who writes a run's folder: one process, or under torchrun rank 0 alone (distributed.py).

The training loops (``offline.py``, ``rl.py``) call these unconditionally; on the other ranks
the sinks are silent and the writers return once rank 0 is done, so no loop carries a branch on
its rank. Every rank computes the same metrics; rank 0 logs them."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from posttrain.distributed import world
from posttrain.rollout.batch import RolloutBatch
from posttrain.run.checkpoint import quiet_progress_bars, save_final
from posttrain.run.checkpoint_checks import NO_FIELDS, StateFields
from posttrain.run.run_dir import prepare_run_dir
from posttrain.telemetry import MetricsLogger, Progress, write_failure_report, write_report
from posttrain.telemetry.report import conversation_text

log = logging.getLogger(__name__)


class Silent:
    """The logger and progress line of a rank that does not write (a null object)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        pass

    def log_eval_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        pass

    def log_warnings(self, step: int, messages: Iterable[str]) -> None:
        pass

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def ready_run_dir(
    out: Path,
    resume: str,
    overwrite: bool,
    config_yaml: str | None,
    echo: Callable[[str], None] = print,
    fields: StateFields = NO_FIELDS,
) -> Path | None:
    """Rank 0 makes the run folder ready (``run_dir.prepare_run_dir``; ``fields``: what the loop's
    checkpoints hold); every rank gets the checkpoint to resume from (None for a fresh start)."""
    ranks = world()
    ready = prepare_run_dir(out, resume, overwrite, config_yaml, echo, fields) if ranks.is_main else None
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


# A page drawn over a run's folder before its report (the rollout viewer's ``rollouts.html``): the
# loop names its pages, so run keeping needs no view of what a run recorded.
Page = Callable[[Path], None]


def finish_run(out: Path, model: nn.Module, tokenizer: Any, title: str, pages: Sequence[Page] = ()) -> None:
    """``final/``, the ``pages`` and the report, written by rank 0; no rank leaves before they are. A
    sharded model's whole weights are gathered first (every rank takes part)."""
    weights = world().full_weights(model)

    def write() -> None:
        with quiet_progress_bars():
            save_final(model, out / "final", tokenizer, weights=weights)
        write_pages(out, pages)
        write_report(out, title=title)

    on_main(write)


def report_failure(out: Path, title: str, error: BaseException, pages: Sequence[Page] = ()) -> None:
    """The failure report (what was logged up to the failure, and why) and the ``pages``, by rank
    0; no collective: the other ranks may be gone."""
    if world().is_main:
        write_pages(out, pages)
        write_failure_report(out, title=title, error=error)


def write_pages(out: Path, pages: Sequence[Page]) -> None:
    """Each page over the run's folder. A page that cannot be drawn is logged, never raised: the
    run's own outcome comes first."""
    for page in pages:
        try:
            page(out)
        except Exception as error:
            log.warning("could not draw %s over %s: %s", getattr(page, "__name__", page), out, error)


def logged_samples(batch: RolloutBatch, count: int) -> list[dict[str, Any]]:
    """``count`` samples of a prepared batch as samples.jsonl records (prompt, completion, reward —
    None where unscored — and the sample's first-token advantage): the best, the worst and the
    median by reward first, then others evenly spread over the ranks, so the report can show
    what the step did at its best and its worst."""
    return [
        {
            "prompt": batch.prompts[i] if isinstance(batch.prompts[i], str) else str(batch.prompts[i]),
            "completion": batch.completions[i],
            "reward": None if math.isnan(float(batch.scores[i])) else float(batch.scores[i]),
            "advantage": float(batch.advantages[i][batch.response_mask[i].bool()][:1].sum()),
        }
        for i in spread_by_reward(batch.scores.tolist(), count)
    ]


def spread_by_reward(scores: Sequence[float], count: int) -> list[int]:
    """Indices of ``count`` samples: the best, the worst, the median (unscored ones rank lowest;
    ties keep batch order), then evenly spaced ranks."""
    ranked = sorted(range(len(scores)), key=lambda i: -math.inf if math.isnan(scores[i]) else scores[i])
    if not ranked or count <= 0:
        return []
    picks = [ranked[-1], ranked[0], ranked[len(ranked) // 2]]
    picks += [ranked[round(k * (len(ranked) - 1) / max(count - 1, 1))] for k in range(count)]
    return list(dict.fromkeys(picks))[:count]


def held_out_records(result: Any) -> list[dict[str, Any]]:
    """An evaluation's answers as eval_samples.jsonl records: prompt, completion (an episode's
    conversation), reward (its return) and ``correct`` — full marks, or the episode resolved;
    None where unscored. ``result``: an ``EvalResult`` or an environment's episode records."""
    if result is None:
        return []
    if isinstance(result, list):  # episodes (sources/episodes.py: episode_record)
        return [
            {"prompt": conversation_text(e["prompt"]), "completion": conversation_text(e["conversation"]),
             "reward": e["return"],
             "correct": e["resolved"] if e["resolved"] is not None else (e["return"] or 0) >= 1.0}
            for e in result
        ]  # fmt: skip
    return [
        {"prompt": s["prompt"] if isinstance(s["prompt"], str) else str(s["prompt"]),
         "completion": s["completion"], "reward": s["reward"],
         "correct": None if s["reward"] is None else s["reward"] >= 1.0}
        for s in result.samples
    ]  # fmt: skip


class WarningTape:
    """The run's ``echo``: prints every line and, once :meth:`listen` has a logger, writes the
    warnings among them (``[warning] ...`` lines, and warnings logged by posttrain's modules)
    to ``warnings.jsonl``, so the report shows them first."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo, self.step, self.logger = echo, 0, None
        self._handler = _LoggedWarnings(self)

    def __call__(self, line: str) -> None:
        self.echo(line)
        if line.lstrip().startswith("[warning]"):
            self.keep(line.split("]", 1)[1].strip())

    def keep(self, message: str) -> None:
        if self.logger is not None:  # the record has its step: "step 12: " is not repeated
            self.logger.log_warnings(self.step, [re.sub(r"^step \d+:\s*", "", message)])

    def listen(self, logger: Any) -> None:
        """Write warnings through ``logger`` (None: stop)."""
        self.logger = logger
        package = logging.getLogger("posttrain")
        if logger is None:
            package.removeHandler(self._handler)
        else:
            package.addHandler(self._handler)


class _LoggedWarnings(logging.Handler):
    def __init__(self, tape: WarningTape) -> None:
        super().__init__(logging.WARNING)
        self.tape = tape

    def emit(self, record: logging.LogRecord) -> None:
        self.tape.keep(record.getMessage())
