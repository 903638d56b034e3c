"""Formats and row validation: errors name file, row and field; skip mode counts reasons."""

from __future__ import annotations

import json
import math
import re

import pytest
from datasets import Dataset

from posttrain.data import DataError, check_row, detect_format, read_dataset, validate_rows
from posttrain.data.formats import infer_format

GOOD = {
    "prompt": {"prompt": "p"},
    "prompt_completion": {"prompt": "p", "completion": "c"},
    "preference": {"prompt": "p", "chosen": "a", "rejected": "b"},
    "conversational": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
}
USER = [{"role": "user", "content": "hi"}]
REPLY = [{"role": "assistant", "content": "b"}]
ASSISTANT = [{"role": "assistant", "content": "yo"}]


def write(path, rows):
    """`rows` as the file type `path` names (jsonl written by hand: rows may be malformed)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_formats_are_detected_from_the_columns():
    assert detect_format(["prompt", "answer"]) == "prompt"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["prompt", "chosen", "rejected", "margin"]) == "preference"
    assert detect_format(["messages", "id"]) == "conversational"
    with pytest.raises(DataError, match=r"\['answer', 'question'\]; expected 'prompt' \(set data\.prompt_column"):
        detect_format(["question", "answer"])


def test_the_format_is_what_most_rows_say():
    # row 0 lacks its completion: it is reported, not read as prompt-only data
    rows = [{"prompt": "p"}, {"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}]
    assert infer_format(rows) == "prompt_completion"
    with pytest.raises(DataError, match=r"^d\.jsonl, row 0, field 'completion': missing; prompt_completion rows"):
        validate_rows(rows, source="d.jsonl")
    assert infer_format([{"prompt": "p"}, {"prompt": "p", "chosen": "a", "rejected": "b"}]) == "preference"  # tie


@pytest.mark.parametrize("data_format", sorted(GOOD))
def test_good_rows_of_every_format_are_kept(data_format):
    report = validate_rows([GOOD[data_format]], source="x")
    assert report.kept == [GOOD[data_format]] and report.data_format == data_format
    assert report.summary() == "all 1 rows are valid"


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": USER},  # a conversational prompt for RL
        {"prompt": USER, "completion": ASSISTANT},
        {"prompt": USER, "chosen": ASSISTANT, "rejected": [{"role": "assistant", "content": "no"}], "margin": 2},
        {"prompt": "p", "chosen": "a", "rejected": "b", "margin": 0.5},
    ],
)
def test_conversational_prompts_and_preferences_are_valid(row):
    assert check_row(row, detect_format(list(row))) is None


@pytest.mark.parametrize(
    ("data_format", "row", "error"),
    [
        ("prompt", {"question": "q"}, "field 'prompt': missing; prompt rows need prompt (row has: question)"),
        ("prompt", {"prompt": None}, "field 'prompt': missing; prompt rows need prompt (row has: prompt)"),
        ("prompt", {"prompt": 3}, "field 'prompt': expected text or a list of messages, found int 3"),
        ("prompt_completion", {"prompt": "p", "completion": 1.5}, "field 'completion': expected text or a list"),
        ("prompt_completion", {"prompt": "p", "completion": "  "}, "field 'completion': empty text"),
        ("prompt_completion", {"prompt": "p", "completion": []}, "field 'completion': an empty list of messages"),
        (
            "prompt_completion",
            {"prompt": USER, "completion": "c"},
            "field 'completion': is text but 'prompt' is messages",
        ),
        ("preference", {"prompt": "p", "chosen": "", "rejected": "b"}, "field 'chosen': empty text"),
        ("preference", {"prompt": "p", "chosen": "a", "rejected": "\n"}, "field 'rejected': empty text"),
        ("preference", {"prompt": "p", "chosen": "a", "rejected": "a"}, "field 'rejected': identical to 'chosen'"),
        ("preference", {"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}, "field 'margin': expected a"),
        ("preference", {"prompt": "p", "chosen": "a", "rejected": "b", "margin": True}, "found bool True"),
        ("preference", {"prompt": "p", "chosen": "a", "rejected": "b", "margin": math.nan}, "found float nan"),
        (
            "preference",
            {"prompt": "p", "chosen": ASSISTANT, "rejected": "b"},
            "field 'chosen': is messages but 'prompt'",
        ),
        ("conversational", {"messages": "hi"}, "field 'messages': expected a list of messages, found str"),
        ("conversational", {"messages": [{"text": "hi"}]}, "message 0 is not a {role, content} object (text)"),
        ("conversational", {"messages": ["hi"]}, "field 'messages': message 0 is not a {role, content} object (str)"),
        (
            "conversational",
            {"messages": [*USER, {"role": "robot", "content": "x"}]},
            "field 'messages': message 1 has unknown role 'robot'; valid: system, user, assistant, tool",
        ),
        ("conversational", {"messages": [{"role": "user", "content": 7}]}, "message 0 content is int 7, expected text"),
        ("conversational", {"messages": USER}, "field 'messages': the last message is 'user''s; it must be"),
        (
            "conversational",
            {"messages": [*USER, {"role": "assistant", "content": " "}]},
            "field 'messages': the assistant's message is empty",
        ),
        # hardening 3, item 7: each was a traceback from the SFT encoder once the model had loaded
        (
            "conversational",
            {"messages": [*USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "field 'messages': messages 1 and 2 are both the assistant's",
        ),
        (
            "conversational",
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}, *USER, *REPLY]},
            "field 'messages': the conversation opens with the assistant's turn",
        ),
        (
            "conversational",
            {"messages": [*USER, {"role": "tool", "content": "5"}, *REPLY]},
            "field 'messages': message 1 is a tool's result answering no call",
        ),
        (
            "conversational",
            {"messages": [*USER, {"role": "assistant", "content": "a"}], "tools": "calculator"},
            "field 'tools': 'calculator' is not a list of schemas",
        ),
        (
            "conversational",
            {"messages": [*USER, {"role": "assistant", "content": "a"}], "tools": [{"function": {"name": "f"}}, 5]},
            "field 'tools': entry 1 is 5, not a function schema",
        ),
    ],
)
def test_a_bad_row_is_named_by_source_row_and_field(data_format, row, error):
    with pytest.raises(DataError) as raised:
        validate_rows([GOOD[data_format], row], source="data.jsonl", data_format=data_format)
    message = str(raised.value)
    assert message.startswith("data.jsonl, row 1, field '"), message
    assert error in message, message


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize(
    ("bad", "where", "error"),
    [
        ({"prompt": "q"}, "field 'completion': missing", "missing 'completion'"),
        ({"prompt": "q", "completion": ""}, "field 'completion': empty text", "empty 'completion'"),
    ],
)
def test_every_file_type_names_the_file_and_row(tmp_path, suffix, bad, where, error):
    rows = [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": "c"}, bad]
    path = write(tmp_path / f"data{suffix}", rows)
    line = " (line 3)" if suffix == ".jsonl" else ""
    with pytest.raises(DataError, match=re.escape(f"data{suffix}, row 2{line}, {where}")):
        read_dataset(path)
    assert read_dataset(path, on_bad_row="skip") == rows[:2]


def test_wrong_types_in_a_file_are_named(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": 42, "completion": "c"}])
    with pytest.raises(DataError, match=r"d\.jsonl, row 1 \(line 2\), field 'prompt': expected text .*, found int 42$"):
        read_dataset(path)


def test_skip_mode_counts_reasons_in_one_line(tmp_path, capsys):
    rows = [{"prompt": "p", "completion": "c"}] * 200
    rows[4] = {"prompt": "p", "completion": ""}
    rows[9] = rows[17] = {"completion": "c"}
    path = write(tmp_path / "d.jsonl", rows)
    kept = read_dataset(path, on_bad_row="skip")
    assert len(kept) == 197
    expected = "skipped 3 of 200 rows: 2 missing 'prompt' (rows 9, 17); 1 empty 'completion' (row 4)"  # most first
    assert capsys.readouterr().out == f"[data] {path}: {expected}\n"


def test_skip_summary_shortens_long_lists_and_counts_kinds_not_details():
    rows = [{"messages": GOOD["conversational"]["messages"]}] + [
        {"messages": [{"role": f"robot{i}", "content": "x"}] * (i + 1)} for i in range(7)
    ]
    report = validate_rows(rows, source="x", on_bad_row="skip")
    assert report.summary() == "skipped 7 of 8 rows: 7 unknown role in 'messages' (rows 1, 2, 3, 4, 5, ...)"


def test_a_source_with_only_bad_rows_is_an_error_even_when_skipping(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "p", "completion": ""}, {"prompt": "p", "completion": " "}])
    with pytest.raises(DataError, match=r"d\.jsonl: no valid row; skipped 2 of 2 rows: 2 empty 'completion'"):
        read_dataset(path, on_bad_row="skip")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl holds no rows"):
        read_dataset(tmp_path / "empty.jsonl")


def test_every_other_column_passes_through_untouched():
    extra = {"answer": "4", "id": 7, "tags": ["a", "b"], "meta": {"k": None}, "score": 0.5}
    rows = [{"prompt": "2+2?", **extra}]
    report = validate_rows(rows, source="x")
    assert report.kept == rows and report.data_format == "prompt"
    assert report.kept[0]["meta"] is extra["meta"]  # the very objects, not copies


def test_prompt_column_renames_and_errors_use_the_users_name():
    rows = [{"question": "2+2?", "answer": "4"}, {"question": 4, "answer": "4"}]
    report = validate_rows(rows[:1], source="x", prompt_column="question")
    assert report.kept == [{"prompt": "2+2?", "answer": "4"}] and rows[0] == {"question": "2+2?", "answer": "4"}
    with pytest.raises(DataError, match=r"^x, row 1, field 'question': expected text"):
        validate_rows(rows, source="x", prompt_column="question")
    skipped = validate_rows(rows, source="x", prompt_column="question", on_bad_row="skip")
    assert skipped.summary() == "skipped 1 of 2 rows: 1 non-text 'question' (row 1)"
    with pytest.raises(
        DataError, match=r"^x, row 1, field 'question': missing; prompt rows need question \(row has: a\)$"
    ):
        validate_rows([{"question": "q"}, {"a": "4"}], source="x", prompt_column="question")
    with pytest.raises(DataError, match=r"^x, row 0: has both 'question' \(data\.prompt_column\) and 'prompt'"):
        validate_rows([{"question": "a", "prompt": "b"}], source="x", prompt_column="question")


def test_a_format_the_run_cannot_use_fails_at_load_time():
    with pytest.raises(DataError, match=r"^x: rows are in the 'prompt' format, but this run needs 'prompt_completion'"):
        validate_rows([{"prompt": "p"}], source="x", allowed_formats=("prompt_completion", "conversational"))


def test_an_explicit_format_is_checked_and_options_are_checked():
    with pytest.raises(DataError, match=r"field 'completion': missing"):
        validate_rows([{"prompt": "p"}], source="x", data_format="prompt_completion")
    with pytest.raises(DataError, match=r"unknown data format 'sft'; valid: prompt, prompt_completion"):
        validate_rows([{"prompt": "p"}], source="x", data_format="sft")
    with pytest.raises(ValueError, match=r"on_bad_row must be 'error' or 'skip', got 'drop'"):
        validate_rows([{"prompt": "p"}], source="x", on_bad_row="drop")


def test_an_implicit_conversational_prompt_is_split_off_at_load_time():
    # TRL's implicit prompt: each side holds the whole conversation; the prompt is what both open with
    system = {"role": "system", "content": "be kind"}
    no = {"role": "assistant", "content": "no"}
    row = {"chosen": [system, *USER, *ASSISTANT], "rejected": [system, *USER, no], "margin": 1.0}
    report = validate_rows([row], source="x")
    assert report.data_format == "preference"
    assert report.kept == [{"prompt": [system, *USER], "chosen": ASSISTANT, "rejected": [no], "margin": 1.0}]


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"chosen": USER + ASSISTANT, "rejected": [{"role": "user", "content": "ho"}, *ASSISTANT]},
         "row 0, field 'chosen': 'chosen' and 'rejected' share no opening message"),
        ({"chosen": USER + ASSISTANT, "rejected": USER + ASSISTANT + USER + ASSISTANT},
         "row 0, field 'chosen': holds nothing after the messages it shares with 'rejected'"),
        ({"chosen": USER + ASSISTANT, "rejected": [*USER, {"role": "user", "content": "x"}, *ASSISTANT]},
         "row 0, field 'rejected': message 0 is 'user''s; a response starts with the assistant's turn"),
        ({"prompt": USER, "completion": USER + ASSISTANT},
         "row 0, field 'completion': message 0 is 'user''s; a response starts with the assistant's turn"),
    ],
)  # fmt: skip
def test_a_conversational_reply_must_follow_its_prompt(row, error):
    with pytest.raises(DataError, match=re.escape(error)):
        validate_rows([row], source="x")


def test_kept_rows_remember_their_row_and_line_after_skipping(tmp_path):
    rows = [{"prompt": "p", "completion": "c"}] * 4
    rows[1] = {"prompt": "p", "completion": ""}
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(json.dumps(row) for row in rows[:2]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[2:])
    )
    kept = read_dataset(path, on_bad_row="skip")
    assert [kept.where(i) for i in range(len(kept))] == ["row 0 (line 1)", "row 2 (line 4)", "row 3 (line 5)"]
