"""Metrics sinks: ``metrics.jsonl`` always, TensorBoard when installed, W&B when asked for.

One JSON object per step (``{"step": 12, "loss/policy": 0.1, ...}``) is the record every
other view is made from (the report, plots, a user's notebook), so it is written and flushed
line by line: a killed run keeps every step it finished.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from posttrain.errors import MissingExtraError

log = logging.getLogger(__name__)


EXTRA_FILES = ("eval_samples.jsonl", "warnings.jsonl")


class MetricsLogger:
    """Writes scalars per step to every enabled sink; a step's sample completions go to
    ``samples.jsonl``, the held-out answers of an evaluation to ``eval_samples.jsonl`` (and to
    W&B as a table, TensorBoard as text), the warnings a run printed to ``warnings.jsonl``.

    ``resume_step``: when a run resumes from a checkpoint at step N, records after N in the
    existing files came from the steps that are about to be redone; they are dropped so the
    files describe one consistent run.
    """

    @classmethod
    def for_run(cls, run_dir: str | Path, config: Any, start_step: int) -> MetricsLogger:
        """The logger of a training run from its config's ``report_to`` and ``run_name`` (every
        loop's config has both), continuing after ``start_step`` when it resumes."""
        return cls(
            run_dir,
            resume_step=start_step if start_step else None,
            tensorboard="tensorboard" in config.report_to,
            wandb="wandb" in config.report_to,
            run_name=config.run_name,
            config=config.model_dump(mode="json"),
        )

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        paths = [self.metrics_path, self.samples_path, *(self.run_dir / name for name in EXTRA_FILES)]
        for path in paths:
            _truncate_after(path, resume_step)
        mode = "a" if resume_step is not None else "w"
        sinks = [path.open(mode, encoding="utf-8") for path in paths]
        self._metrics, self._samples, self._eval_samples, self._warnings = sinks
        self._tensorboard = _open_tensorboard(self.run_dir / "tensorboard") if tensorboard else None
        self._wandb = _open_wandb(run_name or self.run_dir.name, config, self.run_dir) if wandb else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{key: _plain(value) for key, value in metrics.items()}}
        self._metrics.write(json.dumps(record, allow_nan=True) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        _write_lines(self._samples, step, samples)

    def log_eval_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        """An evaluation's answers (prompt, completion, reward, correct), one line each."""
        _write_lines(self._eval_samples, step, samples)
        if self._tensorboard is not None and samples:
            self._tensorboard.add_text("eval_samples", _markdown_table(samples), step)
        if self._wandb is not None and samples:
            import wandb

            columns = list(dict.fromkeys(key for sample in samples for key in sample))
            table = wandb.Table(columns=columns, data=[[str(s.get(c, "")) for c in columns] for s in samples])
            self._wandb.log({"eval_samples": table}, step=step)

    def log_warnings(self, step: int, messages: Iterable[str]) -> None:
        """Warnings the run printed at ``step``: the report shows them first."""
        _write_lines(self._warnings, step, [{"message": message} for message in messages])

    def close(self) -> None:
        for sink in (self._metrics, self._samples, self._eval_samples, self._warnings):
            sink.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a run killed mid-write) is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _write_lines(sink: Any, step: int, records: Iterable[Mapping[str, Any]]) -> None:
    for record in records:
        sink.write(json.dumps({"step": step, **record}, default=str) + "\n")
    sink.flush()


def _markdown_table(samples: list[Mapping[str, Any]]) -> str:
    """Samples as a Markdown table (TensorBoard's text tab renders it); cells on one line."""
    columns = list(dict.fromkeys(key for sample in samples for key in sample))
    cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(s.get(c, "")) for c in columns) + " |" for s in samples])


def _truncate_after(path: Path, step: int | None) -> None:
    if step is None or not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


def _plain(value: Any) -> Any:
    """Tensors and NumPy scalars to Python numbers; everything else unchanged."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value  # json writes NaN/Infinity; a NaN loss must stay visible
    return value


def _open_tensorboard(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed; metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(log_dir=str(folder))


def check_report_to(report_to: Iterable[str]) -> None:
    """The sinks ``report_to`` names can be opened: checked before a model loads."""
    import importlib.util

    if "wandb" in report_to and importlib.util.find_spec("wandb") is None:
        raise MissingExtraError("report_to names wandb, which is not installed: pip install 'posttrain[wandb]'")


WANDB_ID_FILE = "wandb_id"
"""The run's W&B id, kept in the run folder so that a resumed run logs into the same W&B run."""


def _open_wandb(name: str, config: Mapping[str, Any] | None, run_dir: Path) -> Any:
    import os
    import uuid

    check_report_to(["wandb"])
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:16] + "\n", encoding="utf-8")
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "posttrain"),
        name=name,
        id=id_file.read_text(encoding="utf-8").strip(),
        resume="allow",
        config=dict(config or {}),
        dir=str(run_dir),
    )
