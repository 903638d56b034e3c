"""Datasets: local files in the formats users bring, and built-in tasks that generate data.

``read_dataset`` is what a run calls with ``data.path``; ``posttrain.data.tasks.get_task``
what it calls with ``data.task``. Both hand back plain row dicts, validated at load time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from posttrain.data.formats import FORMATS, Problem, ValidationReport, check_row, detect_format, validate_rows
from posttrain.data.loading import DataError, Row, Rows, load_rows

log = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "DataError",
    "Problem",
    "Row",
    "Rows",
    "ValidationReport",
    "check_row",
    "detect_format",
    "load_rows",
    "read_dataset",
    "validate_rows",
]


def read_dataset(
    path: str | Path,
    *,
    data_format: str | None = None,
    prompt_column: str = "prompt",
    on_bad_row: str = "error",
    split: str | None = None,
    allowed_formats: Sequence[str] | None = None,
) -> Rows:
    """Load a local dataset and validate every row before any training starts.

    The options are those of :func:`load_rows` and :func:`validate_rows`. With
    ``on_bad_row="skip"`` bad rows are dropped and a one-line summary says how many and why
    (logged, and printed so that it is seen in a plain terminal too).
    """
    rows = load_rows(path, split=split)
    report = validate_rows(
        rows,
        source=str(path),
        data_format=data_format,
        prompt_column=prompt_column,
        on_bad_row=on_bad_row,
        allowed_formats=allowed_formats,
    )
    if report.skipped:
        message = f"[data] {path}: {report.summary()}"
        log.warning(message)
        print(message, flush=True)
    return report.kept  # Rows: each remembers its row (and line) in the file
