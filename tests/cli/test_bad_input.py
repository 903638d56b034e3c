"""Bad input at the command line (issue 23, acceptance): every invalid config and every
malformed data row ends in one message on stderr that names the key, file or row, exit
status 2, no traceback, no run folder left behind, and (but for what only the model can tell)
before any model is built or loaded. The cases are in ``bad_inputs.py``.

The command runs in this process (``posttrain.cli.main``), which is what ``python -m
posttrain`` calls: an exception escaping ``main`` is exactly what would have printed a
traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from tests.cli.bad_inputs import CONFIG_FILES, Case, config_cases, eval_cases, row_cases

CONFIG_CASES = config_cases() + eval_cases()
ROW_CASES = row_cases()


def test_the_suite_is_as_large_as_promised():
    assert len(CONFIG_CASES) >= 100 and len(ROW_CASES) >= 200


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A tiny model folder as `posttrain sft` writes it (model.path / eval --model)."""
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer

    folder = tmp_path_factory.mktemp("model") / "tiny"
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_case(case: Case, tmp_path: Path, model: Path) -> tuple[int, str]:
    for name, text in {**CONFIG_FILES, **case.files}.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty_folder").mkdir(exist_ok=True)
    data_file = str(tmp_path / next(iter(case.files))) if case.files else ""

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{model}", str(model)).replace("{file}", data_file)

    argv = [fill(arg) for arg in case.argv]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own refusal of a flag's value: usage + one line, status 2
        status = exit_.code
    return status, "\n".join(fill(word) for word in case.expect)


# refused only once the model is built: which layers exist is known from the model alone
NEEDS_THE_MODEL = ("model.lora.target_modules",)


@pytest.fixture
def model_loads(monkeypatch) -> list[str]:
    """Records every policy build and model load of the commands, to show that a refusal came
    before any (the data, rewards and folders are checked first)."""
    import posttrain.cli
    import posttrain.models.loading
    import posttrain.train.recipes
    import posttrain.train.rl

    calls: list[str] = []
    for module, name in [
        (posttrain.train.recipes, "build_model_and_tokenizer"),
        (posttrain.train.rl, "build_model_and_tokenizer"),
        (posttrain.models.loading, "load_causal_lm"),
    ]:
        original = getattr(module, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
    return calls


def check_refused(case: Case, tmp_path: Path, model: Path, capsys, model_loads: list[str]) -> None:
    status, expect = run_case(case, tmp_path, model)
    err = capsys.readouterr().err
    assert status == 2, f"exit status {status}; stderr: {err}"
    assert "Traceback" not in err
    missing = [word for word in expect.split("\n") if word not in err]
    assert not missing, f"the message does not name {missing}: {err}"
    run = tmp_path / "run"
    assert not run.exists() or not any(run.iterdir()), f"a refused run left files: {sorted(run.rglob('*'))}"
    if not any(key in case.id for key in NEEDS_THE_MODEL):
        assert not model_loads, f"refused only after {model_loads}: checkable before any model loads"


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[case.id for case in CONFIG_CASES])
def test_an_invalid_config_is_one_message_naming_the_key(case, tmp_path, saved_model, capsys, model_loads):
    check_refused(case, tmp_path, saved_model, capsys, model_loads)


@pytest.mark.parametrize("case", ROW_CASES, ids=[case.id for case in ROW_CASES])
def test_a_malformed_row_is_one_message_naming_file_and_row(case, tmp_path, saved_model, capsys, model_loads):
    check_refused(case, tmp_path, saved_model, capsys, model_loads)


LONG = "x" * 300  # the models' context is 256 positions below, and the char tokenizer one token per character
PAIR = {"prompt": "Say:", "chosen": " ok", "rejected": " no"}
LONG_ROWS = {
    "sft": ({"prompt": "Say:", "completion": " ok"}, {"prompt": "Say:", "completion": LONG}),
    "rm": ({"prompt": "Say:", "chosen": " ok", "rejected": " no"}, {"prompt": LONG, "chosen": " a", "rejected": " b"}),
    "dpo": (
        {"prompt": "Say:", "chosen": " ok", "rejected": " no"},
        {"prompt": "Say:", "chosen": LONG, "rejected": " b"},
    ),
    "rl": ({"prompt": "Say:"}, {"prompt": LONG[:250]}),  # 250 + max_new_tokens 16 > 256
}


@pytest.mark.parametrize("command", sorted(LONG_ROWS))
def test_rows_longer_than_the_context_are_refused_or_skipped_by_the_stated_rule(command, tmp_path, capsys):
    from tests.cli.bad_inputs import BASE, SMALL_RUN

    good, long = LONG_ROWS[command]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in [good, long, good, good, long, good]))
    argv = [*BASE[command], *SMALL_RUN, f"data.path={data}", "data.task=null", "model.tiny.max_positions=256"]
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    if command == "rl":  # the room a prompt needs is its tokens plus max_new_tokens
        argv += ["max_new_tokens=16", "rewards=[length]"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "2 of 6 rows" in err or "2 of 6 prompts" in err, err
    assert "context of 256 tokens" in err and "rows 1, 4" in err and "data.on_bad_row=skip" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    assert main([*argv, "data.on_bad_row=skip"]) == 0
    out = capsys.readouterr().out
    assert "[data] skipped 2 of 6" in out and "rows 1, 4" in out
