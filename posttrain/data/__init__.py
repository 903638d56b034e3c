"""Datasets: local files in the formats users bring, and built-in tasks that generate data."""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.data.formats import FORMATS, ValidationReport, detect_format, validate_rows
from posttrain.data.loading import DataError, Row, load_rows

log = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "DataError",
    "Row",
    "ValidationReport",
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
) -> list[Row]:
    """Load a local dataset and validate every row before any training starts.

    With ``on_bad_row="skip"`` bad rows are dropped and a one-line summary says how many and
    why (logged, and printed so it is seen in a plain terminal).
    """
    rows = load_rows(path, split=split)
    report = validate_rows(
        rows, source=str(path), data_format=data_format, prompt_column=prompt_column, on_bad_row=on_bad_row
    )
    if report.skipped:
        message = f"[data] {path}: {report.summary(len(rows))}"
        log.warning(message)
        print(message, flush=True)
    return report.kept
