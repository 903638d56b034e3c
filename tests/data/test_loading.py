"""Loading local files: every file type gives the same rows; a bad file is named with its line."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from posttrain.data import DataError, Rows, load_rows

ROWS = [
    {"prompt": "Reverse the name: sean. Answer:", "completion": " naes.", "difficulty": 1},
    {"prompt": "Reverse the name: joel. Answer:", "completion": " leoj.", "difficulty": 2},
]


def write_every_type(folder):
    """The same rows as each file type the loader reads; returns the names written."""
    # a blank line in the middle and at the end: skipped
    (folder / "d.jsonl").write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n\n")
    (folder / "d.json").write_text(json.dumps(ROWS))
    (folder / "wrapped.json").write_text(json.dumps({"data": ROWS}))
    Dataset.from_list(ROWS).to_parquet(str(folder / "d.parquet"))
    Dataset.from_list(ROWS).to_csv(str(folder / "d.csv"), index=False)
    Dataset.from_list(ROWS).save_to_disk(str(folder / "saved"))
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(folder / "one_split"))
    return ["d.jsonl", "d.json", "wrapped.json", "d.parquet", "d.csv", "saved", "one_split"]


def test_every_file_type_gives_the_same_rows(tmp_path):
    for name in write_every_type(tmp_path):
        rows = load_rows(tmp_path / name)
        assert rows == ROWS, name
        assert isinstance(rows, list) and type(rows[0]) is dict, name
        assert type(rows[0]["difficulty"]) is int, name  # csv too: pyarrow infers the column's type


def test_jsonl_rows_remember_their_lines(tmp_path):
    write_every_type(tmp_path)
    rows = load_rows(tmp_path / "d.jsonl")
    assert isinstance(rows, Rows) and rows.line_numbers == [1, 3]
    assert rows.where(1) == "row 1 (line 3)"
    assert load_rows(tmp_path / "d.parquet").where(1) == "row 1"


def test_nested_columns_survive_every_type(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "tags": ["a", "b"], "meta": {"k": 1.5}}]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.jsonl", "d.parquet", "saved"):
        assert load_rows(tmp_path / name) == rows, name


def test_splits_of_a_saved_dataset_dict(tmp_path):
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "splits")
    )
    assert load_rows(tmp_path / "splits", split="test") == ROWS[:1]
    assert load_rows(tmp_path / "splits", split="train") == ROWS
    with pytest.raises(DataError, match=r"splits holds several splits; choose one with data\.split: train, test$"):
        load_rows(tmp_path / "splits")
    with pytest.raises(DataError, match=r"splits has no split 'dev'; available: train, test$"):
        load_rows(tmp_path / "splits", split="dev")
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "one_split"))
    assert load_rows(tmp_path / "one_split") == ROWS  # the only split needs no name
    with pytest.raises(DataError, match=r"one_split has no split 'test'; available: train$"):
        load_rows(tmp_path / "one_split", split="test")


def test_a_split_where_there_are_none_is_an_error(tmp_path):
    write_every_type(tmp_path)
    with pytest.raises(DataError, match=r"d\.jsonl: a single file has no splits; drop split='train'"):
        load_rows(tmp_path / "d.jsonl", split="train")
    with pytest.raises(DataError, match=r"saved holds a single dataset with no splits"):
        load_rows(tmp_path / "saved", split="train")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b'{"prompt": "a"}\n\n{"prompt": "b"\n',
            r"bad\.jsonl, line 3: invalid JSON \(Expecting ',' delimiter at column 15\)$",
        ),
        (
            b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
            r"bad\.jsonl, line 2: not valid UTF-8 \(invalid continuation byte at byte 16 of the line\)$",
        ),
        (b'{"prompt": "a"}\n["a", "list"]\n', r"bad\.jsonl, line 2: expected a JSON object, found an array$"),
        (b'{"prompt": "a"}\n"text"\n', r"bad\.jsonl, line 2: expected a JSON object, found a string$"),
    ],
)
def test_a_malformed_jsonl_line_is_named_by_number(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_rows(tmp_path / "bad.jsonl")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'[{"prompt": "a"},', r"bad\.json: invalid JSON \(Expecting value at line 1, column 18\)$"),
        (b'{"rows": []}', r'bad\.json: expected a list of objects \(or {"data": \[\.\.\.\]}\), found an object$'),
        (b'[{"prompt": "a"}, 3]', r"bad\.json, row 1: expected a JSON object, found a number$"),
        (b'["\xff"]', r"bad\.json: not valid UTF-8"),
    ],
)
def test_a_malformed_json_file_is_named(tmp_path, content, message):
    (tmp_path / "bad.json").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_rows(tmp_path / "bad.json")


def test_unreadable_paths_are_named(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl' does not exist \(looked for "):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"d\.txt: unsupported file type '\.txt'; use one of \.jsonl, \.json"):
        load_rows(tmp_path / "d.txt")
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"d\.parquet: cannot be read as parquet"):
        load_rows(tmp_path / "d.parquet")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder is a folder but not one written by datasets' save_to_disk"):
        load_rows(tmp_path / "folder")
