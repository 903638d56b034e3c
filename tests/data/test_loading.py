"""Loading local files and validating rows: errors name file, row and field."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from posttrain.data import DataError, detect_format, load_rows, read_dataset, validate_rows

ROWS = [
    {"prompt": "Reverse the name: sean. Answer:", "completion": " naes.", "difficulty": 1},
    {"prompt": "Reverse the name: joel. Answer:", "completion": " leoj.", "difficulty": 2},
]


def write_all(folder):
    (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    (folder / "d.json").write_text(json.dumps(ROWS))
    (folder / "wrapped.json").write_text(json.dumps({"data": ROWS}))
    Dataset.from_list(ROWS).to_parquet(str(folder / "d.parquet"))
    Dataset.from_list(ROWS).to_csv(str(folder / "d.csv"), index=False)
    Dataset.from_list(ROWS).save_to_disk(str(folder / "saved"))
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(folder / "splits")
    )


def test_every_file_type_gives_the_same_rows(tmp_path):
    write_all(tmp_path)
    for name in ("d.jsonl", "d.json", "wrapped.json", "d.parquet", "d.csv", "saved"):
        assert load_rows(tmp_path / name) == ROWS, name
    assert load_rows(tmp_path / "splits", split="test") == ROWS[:1]
    with pytest.raises(DataError, match="available: train, test"):
        load_rows(tmp_path / "splits")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "a"}\n{"prompt": "b"\n', r"bad\.jsonl, line 2: invalid JSON"),
        (b'{"prompt": "a"}\n\xff\xfe{"prompt": "b"}\n', r"bad\.jsonl, line 2: not valid UTF-8"),
        (b'{"prompt": "a"}\n["a list"]\n', r"bad\.jsonl, line 2: expected a JSON object, found list"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_rows(tmp_path / "bad.jsonl")


def test_unknown_paths_and_types(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'"):
        load_rows(tmp_path / "d.txt")


@pytest.mark.parametrize(
    ("row", "fmt", "message"),
    [
        ({"question": "q"}, "prompt", "field 'prompt': missing"),
        ({"prompt": 3}, "prompt", "field 'prompt': expected text, found int"),
        ({"prompt": "p", "completion": "  "}, "prompt_completion", "field 'completion': empty"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "preference", "field 'rejected': identical to chosen"),
        ({"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}, "preference", "field 'margin'"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "conversational", "message 0 has unknown role 'robot'"),
        ({"messages": [{"text": "hi"}]}, "conversational", "field 'messages': message 0 is not a"),
        ({"messages": []}, "conversational", "field 'messages': expected a non-empty list"),
    ],
)
def test_bad_rows_are_reported_by_index_and_field(row, fmt, message):
    good = {
        "prompt": {"prompt": "p"},
        "prompt_completion": {"prompt": "p", "completion": "c"},
        "preference": {"prompt": "p", "chosen": "a", "rejected": "b"},
        "conversational": {"messages": [{"role": "user", "content": "hi"}]},
    }[fmt]
    with pytest.raises(DataError) as error:
        validate_rows([good, row], source="data.jsonl", data_format=fmt)
    assert str(error.value).startswith("data.jsonl, row 1, field '") and message in str(error.value)


def test_skip_mode_counts_reasons_and_all_bad_is_an_error(tmp_path, capsys):
    rows = [
        {"prompt": "p", "completion": "c"},
        {"prompt": "p", "completion": ""},
        {"completion": "c"},
        {"prompt": "q", "completion": ""},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = read_dataset(path, data_format="prompt_completion", on_bad_row="skip")
    assert kept == rows[:1]
    assert "skipped 3 of 4 rows: 2 empty in 'completion' (rows 1, 3); 1 missing in 'prompt' (row 2)" in (
        capsys.readouterr().out
    )
    with pytest.raises(DataError, match="no valid row"):
        validate_rows(rows[1:], source="x", data_format="prompt_completion", on_bad_row="skip")


def test_formats_are_detected_and_columns_pass_through():
    assert detect_format(["prompt", "answer"]) == "prompt"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["prompt", "chosen", "rejected", "margin"]) == "preference"
    assert detect_format(["messages"]) == "conversational"
    with pytest.raises(DataError, match=r"data\.prompt_column"):
        detect_format(["question", "answer"])
    report = validate_rows([{"question": "2+2?", "answer": "4"}], source="x", prompt_column="question")
    assert report.kept == [{"prompt": "2+2?", "answer": "4"}]
