"""Read rows from the local files users bring: jsonl, json, parquet, csv, or a saved
``datasets`` folder. Rows are plain dicts; every column is kept (reward functions see them).

JSON Lines are read line by line so that a bad line is reported by its number; the other
formats go through pyarrow / ``datasets``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Row = dict[str, Any]
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, row and field."""


def load_rows(path: str | Path, *, split: str | None = None) -> list[Row]:
    """All rows of a local data file or saved ``datasets`` folder, as dicts."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data path {str(path)!r} does not exist (posttrain reads local files only)")
    if path.is_dir():
        return _load_saved_dataset(path, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _load_jsonl(path)
    if suffix == ".json":
        return _load_json(path)
    if suffix in (".parquet", ".csv"):
        return _load_tabular(path, suffix)
    raise DataError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)} or a datasets folder")


def _load_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path}, line {number}: not valid UTF-8 ({error.reason} at byte {error.start})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}, line {number}: invalid JSON ({error.msg}, column {error.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {number}: expected a JSON object, found {type(row).__name__}")
            rows.append(row)
    return rows


def _load_json(path: Path) -> list[Row]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: invalid JSON ({error.msg}, line {error.lineno} column {error.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f'{path}: expected a list of objects (or {{"data": [...]}}), found {type(data).__name__}')
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path}, row {index}: expected an object, found {type(row).__name__}")
    return data


def _load_tabular(path: Path, suffix: str) -> list[Row]:
    import pyarrow.csv
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(path) if suffix == ".parquet" else pyarrow.csv.read_csv(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for damaged files
        raise DataError(f"{path}: cannot be read as {suffix[1:]} ({error})") from None
    return table.to_pylist()


def _load_saved_dataset(path: Path, split: str | None) -> list[Row]:
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(f"{path} is a folder but not a saved datasets folder (save_to_disk output)") from None
    if isinstance(data, DatasetDict):
        if split is None and len(data) == 1:
            split = next(iter(data))
        if split not in data:
            raise DataError(f"{path}: choose a split with data.split; available: {', '.join(data)}")
        data = data[split]
    assert isinstance(data, Dataset)
    return data.to_list()
