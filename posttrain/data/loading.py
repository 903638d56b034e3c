"""Read rows from the local files users bring: jsonl, json, parquet, csv, or a saved
``datasets`` folder. Rows are plain dicts and every column is kept (reward functions see them).

Rows are returned as a list: they are small here and the RL loop samples them at random.
JSON Lines are read line by line so that a bad line is reported by its number, and the rows
remember their line numbers so that later validation can point at the line too. The other
formats go through pyarrow or ``datasets``, which read them faster and type them better than
we would by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.hub import hub_repo_id, hub_snapshot

Row = dict[str, Any]
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(PosttrainError, ValueError):
    """A data file that cannot be used; the message names the file, row and field."""


class Rows(list[Row]):
    """The rows of one source: a plain list, plus where each row sits in its file.

    ``line_numbers[i]`` is the 1-based line of row ``i`` in a JSON Lines file (blank lines
    make it differ from ``i + 1``); ``None`` for formats without lines. ``indices[i]`` is
    row ``i``'s index in its file when some rows were left out (validation skipping bad
    rows), so that a later error still names the row the user can find.
    """

    def __init__(
        self, rows: list[Row], line_numbers: list[int] | None = None, indices: list[int] | None = None
    ) -> None:
        super().__init__(rows)
        self.line_numbers, self.indices = line_numbers, indices

    def where(self, index: int) -> str:
        """``"row 4"``, or ``"row 4 (line 6)"`` when the line is known."""
        row = index if self.indices is None else self.indices[index]
        if self.line_numbers is None:
            return f"row {row}"
        return f"row {row} (line {self.line_numbers[index]})"

    def replaced(self, rows: list[Row]) -> Rows:
        """Other rows (transformed copies of these, in the same order) at the same places."""
        return Rows(rows, self.line_numbers, self.indices)


def load_rows(path: str | Path, *, split: str | None = None) -> Rows:
    """All rows of a local data file or a ``save_to_disk`` folder, as dicts.

    `split` picks one split of a saved ``DatasetDict``; it may be left out when the folder
    holds one split only. A file, or a folder with a single ``Dataset``, has no splits, and
    naming one is an error rather than silently ignored.
    """
    given, path = str(path), Path(path).expanduser()
    if not path.exists():
        message = f"data path {given!r} does not exist (looked for {path.resolve()})"
        if hub_repo_id(given) is not None:
            snapshot, reason = hub_snapshot(given, repo_type="dataset")
            if snapshot is not None:
                return _load_hub_snapshot(snapshot, given, split)
            message += f", and as a Hub dataset id it is neither in the Hugging Face cache nor downloadable ({reason})"
        raise DataError(message)
    if path.is_dir():
        return _load_saved_dataset(path, split)
    if split is not None:
        raise DataError(f"{path}: a single file has no splits; drop split={split!r} (data.split)")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _load_jsonl(path)
    if suffix == ".json":
        return _load_json(path)
    if suffix in (".parquet", ".csv"):
        return _load_tabular(path, suffix)
    raise DataError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)} or a datasets folder")


def _load_jsonl(path: Path) -> Rows:
    rows, line_numbers = [], []
    # bytes, not text: a non-UTF-8 line is then reported by its number instead of aborting
    # the whole read with an offset into the file
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path}, line {number}: not valid UTF-8 ({error.reason} at byte {error.start + 1} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # so that a column past the end is on this line
            except json.JSONDecodeError as error:
                raise DataError(f"{path}, line {number}: invalid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {number}: expected a JSON object, found {_json_type(row)}")
            rows.append(row)
            line_numbers.append(number)
    return Rows(rows, line_numbers)


def _load_json(path: Path) -> Rows:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: invalid JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f'{path}: expected a list of objects (or {{"data": [...]}}), found {_json_type(data)}')
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path}, row {index}: expected a JSON object, found {_json_type(row)}")
    return Rows(data)


def _load_tabular(path: Path, suffix: str) -> Rows:
    import pyarrow.csv
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(path) if suffix == ".parquet" else pyarrow.csv.read_csv(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for damaged files
        raise DataError(f"{path}: cannot be read as {suffix[1:]} ({error})") from None
    return Rows(table.to_pylist())


def _load_hub_snapshot(folder: Path, repo_id: str, split: str | None) -> Rows:
    """A Hub dataset's files (jsonl, json, parquet, csv; splits from the file names, as on the Hub)."""
    from datasets import load_dataset

    try:
        data = load_dataset(str(folder))
    except Exception as error:  # no data files, mixed formats, ...: datasets says which
        raise DataError(f"data path {repo_id!r} (Hub snapshot {folder}): cannot be read ({error})") from None
    return Rows(_one_split(data, repo_id, split).to_list())


def _load_saved_dataset(path: Path, split: str | None) -> Rows:
    from datasets import load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(
            f"{path} is a folder but not one written by datasets' save_to_disk; "
            f"give a file ({', '.join(SUFFIXES)}) or a saved dataset"
        ) from None
    return Rows(_one_split(data, str(path), split).to_list())


def _one_split(data: Any, where: str, split: str | None) -> Any:
    """The split of a DatasetDict that ``split`` names (or its only one); a Dataset as it is."""
    from datasets import Dataset, DatasetDict

    if isinstance(data, DatasetDict):
        splits = ", ".join(data)
        if split is None and len(data) == 1:
            split = next(iter(data))
        if split is None:
            raise DataError(f"{where} holds several splits; choose one with data.split: {splits}")
        if split not in data:
            raise DataError(f"{where} has no split {split!r}; available: {splits}")
        data = data[split]
    elif split is not None:
        raise DataError(f"{where} holds a single dataset with no splits; drop split={split!r} (data.split)")
    assert isinstance(data, Dataset)
    return data


def _json_type(value: Any) -> str:
    """JSON's name for a parsed value's type (what the user wrote, not Python's name)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")
