"""The ``tools`` environment from the command line, as a user brings it: a module of plain
functions in the working directory, named by ``env.options.tools``; nothing else.

The policy is a tiny Llama with a character tokenizer and a Hermes-format chat template
(``templates/hermes.jinja``): left random it never calls a tool, which the run must say; given
a few SFT steps on one call it calls ``add`` every turn, whose results come back; cut by a small
``max_new_tokens`` every call is malformed, which stops the run with three of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.telemetry.metrics import read_jsonl

TEMPLATE = Path(__file__).parent / "templates" / "hermes.jinja"
USER_MODULE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def mul(a: int, b: int) -> int:
    return a * b


def answered(prompts, completions, answer, **columns):
    """1 when the last turn of the conversation holds the row's answer."""
    return [float(str(a) in c[-1]["content"]) for c, a in zip(completions, answer)]
'''
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ROWS = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a, b in [(2, 3), (4, 4), (1, 6), (3, 3)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(a random policy, one that has learnt to write CALL) with the Hermes template."""
    from posttrain.envs.tool_env import resolve_tools, tool_schema
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import DEFAULT_CHARSET, build_char_tokenizer

    folder = tmp_path_factory.mktemp("models")
    (folder / "mymod.py").write_text(USER_MODULE)
    tokenizer = build_char_tokenizer(DEFAULT_CHARSET + '{}[]"#')  # JSON's characters too
    tokenizer.chat_template = TEMPLATE.read_text()
    model = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=64, heads=4, tokenizer=tokenizer, max_positions=2048)
    model.save_pretrained(folder / "random")
    tokenizer.save_pretrained(folder / "random")
    # what the policy sees: the template's rendering with the tools, as the environment gives them
    import sys

    sys.path.insert(0, str(folder))
    try:
        tools = [tool_schema(f) for f in resolve_tools(["mymod:add", "mymod:mul"]).values()]
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("mymod", None)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tools=tools, tokenize=False,
                                      add_generation_prompt=True)
        for row in ROWS
    ]  # fmt: skip
    data = folder / "calls.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": CALL}) + "\n" for p in prompts))
    sft = ["sft", f"model.path={folder / 'random'}", f"data.path={data}", "steps=80", "batch_size=4"]
    assert main([*sft, "learning_rate=3e-3", "report_to=[]", f"output_dir={folder / 'sft'}"]) == 0
    return folder / "random", folder / "sft" / "final"


def run_tools(work: Path, model: Path, *extra: str) -> int:
    (work / "mymod.py").write_text(USER_MODULE)
    (work / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    args = [
        "rl", "env.name=tools", "env.options.tools=[mymod:add,mymod:mul]", f"model.path={model}",
        "data.path=rows.jsonl", "rewards=[mymod:answered]", "allow_constant_reward=[answered]", "steps=2",
        "prompts_per_step=2", "samples_per_prompt=2", "max_new_tokens=80", "env.max_turns=2", "report_to=[]",
        "temperature=0.05",  # the learnt call, written as learnt: a sampled typo would be a malformed call
        "reward_workers=0",  # a string check: threads; a worker pool would leave its resource tracker running
        "output_dir=run",
    ]  # fmt: skip
    cwd = Path.cwd()
    try:
        import os

        os.chdir(work)
        return main([*args, *extra])
    finally:
        os.chdir(cwd)
        import sys

        sys.modules.pop("mymod", None)


def test_plain_functions_from_the_working_directory_are_the_tools(tmp_path, models):
    _, caller = models
    assert run_tools(tmp_path, caller) == 0
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "tools/calls_per_episode" in r]
    assert len(records) == 2
    assert all(r["tools/episodes_with_a_call"] == 1.0 and r["tools/malformed_fraction"] == 0.0 for r in records)
    assert all(r["tools/calls_per_episode"] >= 1 and r["tools/unknown_fraction"] == 0.0 for r in records)
    # the user's add ran on the arguments the policy wrote, and its result came back as a tool turn
    call, result = read_jsonl(tmp_path / "run" / "samples.jsonl")[0]["completion"][:2]
    assert call == {"role": "assistant", "content": CALL}
    assert result == {"role": "tool", "content": "5", "name": "add"}


def test_a_run_in_which_no_episode_calls_a_tool_says_so(tmp_path, models, capsys):
    random, _ = models
    assert run_tools(tmp_path, random) == 0
    assert "no episode called a tool" in capsys.readouterr().out
    warnings = [w["message"] for w in read_jsonl(tmp_path / "run" / "warnings.jsonl")]
    assert any("no episode called a tool" in w for w in warnings)
    assert "no episode called a tool" in (tmp_path / "run" / "report.html").read_text()


def test_malformed_calls_above_the_limit_stop_the_run_with_three_of_them(tmp_path, models, capsys):
    _, caller = models
    # every call cut mid-JSON; one turn an episode, so every episode is all malformed turns
    assert run_tools(tmp_path, caller, "max_new_tokens=30", "env.max_turns=1") == 2
    err = capsys.readouterr().err
    assert "held a tool call that could not be read, more than env.max_malformed_fraction = 0.5" in err
    assert err.count("without </tool_call> (cut by max_new_tokens?)") == 3 and "Traceback" not in err


def test_a_tool_path_that_does_not_import_is_refused_before_the_model_loads(tmp_path, models, capsys):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    args = ["rl", "env.name=tools", "env.options.tools=[nomod:add]", f"model.path={models[0]}"]
    assert main([*args, "data.path=rows.jsonl", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "env.options.tools entry 'nomod:add': cannot import module 'nomod'" in err
    assert not (tmp_path / "run").exists()
