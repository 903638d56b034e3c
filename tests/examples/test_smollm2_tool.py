"""The tool-use recipe (SmolLM2-135M-Instruct and a calculator): the whole script — measure the
shipped model without and with the tool, record cold-start episodes, SFT on every assistant turn,
measure with the tools on, off and reworded, GRPO with the tools environment, the same measurements,
SmolLM2's response template shipped with final/, final/ through plain transformers — runs end to
end on a tiny local stand-in with a ChatML template like SmolLM2's. The real runs are measured in
docs/real-models.md."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from posttrain.train.rl_config import load_rl_config
from tests.examples import load_example as load_examples_module

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install 'posttrain[tasks]'")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (ROOT / "tests" / "envs" / "templates" / "chatml.jinja").read_text()


def load_example():
    return load_examples_module("smollm2_tool")


def test_the_config_plays_the_calculator_in_smollm2s_format_on_problems_with_their_parentheses():
    config = load_rl_config(ROOT / "configs" / "smollm2_calculator.yaml")
    assert config.env.name == "tools" and config.env.options["format"] == "smollm2"
    assert config.env.options["tools"] == ["posttrain.envs.tool_library:calculate"]
    assert "{tools}" in config.env.options["system"] and config.rewards == ["reasoning_gym"]
    # without parentheses reasoning-gym's answers follow its hidden tree, not the written precedence
    assert config.data.task_options["allow_parentheses"] is True
    assert config.model.lora is not None and config.eval_size == 300 and config.data.n_eval >= 300


def _stand_in(folder: Path) -> None:
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import train_bpe_tokenizer

    corpus = ['<tool_call>[{"name": "calculate", "arguments": {"expression": "( 241 + -468 ) * -607"}}]</tool_call>',
              "Calculate 722 - 330 * 768. Use the calculator, then give only the final number <answer>-1155</answer>",
              "You are an expert in composing functions. You have access to the following tools:"]  # fmt: skip
    tokenizer = train_bpe_tokenizer(corpus * 8, vocab_size=400, extra_special_tokens=("<|im_start|>", "<|im_end|>"))
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.chat_template = "<|im_end|>", "<|im_end|>", TEMPLATE
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer, max_positions=4096)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


SMALL_RL = ["data.n_train=16", "data.n_eval=4", "eval_size=4", "steps=2", "prompts_per_step=2", "samples_per_prompt=2"]
SMALL_RL += ["micro_batch_size=2", "max_new_tokens=8", "eval_batch_size=8", "preflight=false"]
SMALL_SFT = ["steps=2", "batch_size=2", "warmup_steps=0", "model.gradient_checkpointing=false"]


def test_the_recipe_records_a_cold_start_then_trains_with_the_tool_and_measures_every_stage(tmp_path, capsys):
    example = load_example()
    _stand_in(tmp_path / "base")  # present, so the GGUF import is skipped
    argv = ["--output-dir", str(tmp_path), "--seed", "1", "--cold-start-rows", "6"]
    summary = example.main([*argv, "--rl", *SMALL_RL, "--sft", *SMALL_SFT])
    run = tmp_path / "calculator-1"
    stages = json.loads((run / "stages.json").read_text())
    assert list(stages) == [
        "settings", "shipped_without_tools", "shipped", "cold_start_rows", "sft", "after_sft", "after_sft_tools_off",
        "after_sft_reworded", "rl_settings", "rl", "response_template", "trained", "trained_tools_off",
        "trained_reworded", "plain_transformers",
    ]  # fmt: skip
    # the cold start: episodes of the tools environment, the call in SmolLM2's format, the tool's real answer
    from posttrain.envs.tool_formats import resolve_format

    rows = [json.loads(line) for line in (run / "cold_start.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        system, user, call, result, answer = row["messages"]
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert '"name": "calculate"' in system["content"] and "Use the calculator" in user["content"]
        (parsed,) = resolve_format("smollm2").parse(call["content"]).calls
        assert parsed.name == "calculate" and str(eval(parsed.arguments["expression"])) == result["content"]
        assert answer["content"] == f"<answer>{result['content']}</answer>"
    # every measurement has the figures; the ablations and the reworded prompt after each stage
    tool_use = {"greedy", "greedy_stderr", "episodes_with_a_call", "calls_per_episode", "well_formed_calls"}
    assert tool_use <= set(summary["shipped"]) and "mean@4" not in summary["shipped"]  # it never calls: greedy only
    for figures in (summary["after_sft"], summary["after_rl"]):
        assert tool_use | {"mean@4", "mean@4_stderr"} <= set(figures)
        assert (4 * figures["greedy"]).is_integer() and (16 * figures["mean@4"]).is_integer()
    for figures in (summary["after_sft"], summary["after_rl"]):
        assert {"greedy", "greedy_stderr", "episodes_with_a_call"} <= set(figures["tools_off"]) <= set(figures)
        assert set(figures["reworded"]) == set(figures["tools_off"])
    assert summary["rl_gain"]["gain"] == summary["after_rl"]["greedy"] - summary["after_sft"]["greedy"]
    after_rl_off = summary["after_rl"]["tools_off"]["greedy"]
    after_rl = summary["after_rl"]
    assert summary["tools_off_loss"]["gain"] == after_rl["greedy"] - after_rl["tools_off"]["greedy"]
    assert set(summary["shipped_without_tools"]) >= {"greedy", "greedy_stderr", "mean@4", "mean@4_stderr"}
    # final/ is a plain model folder whose tokenizer reads SmolLM2's calls with transformers' parser
    final = run / "grpo" / "final"
    assert (final / "config.json").exists() and not (final / "adapter_config.json").exists()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    message = tokenizer.parse_response(rows[0]["messages"][2]["content"], prefix="")
    assert message["tool_calls"][0]["function"]["name"] == "calculate"
    assert 0.0 <= summary["plain_transformers"]["greedy"] <= 1.0
    assert "smollm2_tool.png" in (run / "grpo" / "report.html").read_text()
    assert json.loads((run / "summary.json").read_text()) == json.loads(json.dumps(summary))
    # the README's table, from the summary: a row per figure, the seed's cell in each
    table = load_examples_module("smollm2_tool_table").table({"1": summary}).splitlines()
    assert table[0] == "| 300 held-out problems | seed 1 |" and len(table) == 2 + 16
    assert f"| after GRPO, tools off: greedy | {100 * after_rl_off:.1f}%" in "\n".join(table)
    # a second run reads every finished stage back
    metrics = (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns
    assert example.main([*argv, "--rl", *SMALL_RL, "--sft", *SMALL_SFT])["after_rl"] == summary["after_rl"]
    assert (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns == metrics
    # an RL stage stopped part-way continues from its checkpoint instead of starting over
    ledger = json.loads((run / "stages.json").read_text())
    kept = dict(list(ledger.items())[: list(ledger).index("rl")])
    (run / "stages.json").write_text(json.dumps(kept))
    capsys.readouterr()
    example.main([*argv, "--rl", *SMALL_RL, "--sft", *SMALL_SFT])
    assert "[resume] step 2 restored from" in capsys.readouterr().out
    assert list(json.loads((run / "stages.json").read_text())) == list(stages)
    # other RL settings are refused with the stage to redo from; the stages before RL are kept
    sft = stages["sft"]
    with pytest.raises(SystemExit, match="--redo-from rl_settings"):
        example.main([*argv, "--rl", *SMALL_RL, "learning_rate=1e-5", "--sft", *SMALL_SFT])
    example.main([*argv, "--rl", *SMALL_RL, "learning_rate=1e-5", "--sft", *SMALL_SFT, "--redo-from", "rl_settings"])
    again = json.loads((run / "stages.json").read_text())
    assert again["sft"] == sft and list(again) == list(stages)
    assert (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns != metrics


def test_with_the_tools_off_the_model_gets_no_result_from_its_call(tmp_path):
    from posttrain.envs import resolve_environment
    from posttrain.envs.tool_formats import ToolCall, resolve_format

    config = load_rl_config(ROOT / "configs" / "smollm2_calculator.yaml", ["env.options.tools_off=true"])
    env = resolve_environment(config.env.name, config.env.options)()
    env.reset({"prompt": "Calculate 2 * 3."})
    call = resolve_format("smollm2").render([ToolCall("calculate", {"expression": "2 * 3"})])
    (reply,), _, done = asyncio.run(env.step(call))
    assert "6" not in reply["content"] and "off" in reply["content"] and not done


def test_plain_transformers_answers_a_call_it_cannot_read_as_the_environment_does():
    """A call cut mid-JSON (seed 0's final/ wrote one into a 300-problem measurement) made
    ``parse_response`` raise and stopped the recipe's last stage: such a turn is now answered with the
    tools environment's malformed reply, and the episode goes on as it would in the environment."""
    from posttrain.envs.tool_env import MALFORMED_REPLY
    from posttrain.envs.tool_library import calculate
    from posttrain.models.tokenizers import build_char_tokenizer

    example = load_example()
    tokenizer = build_char_tokenizer()
    tokenizer.response_template = example.SMOLLM2_RESPONSE_TEMPLATE
    prompt = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    cut, chat = '<tool_call>[{"name": "calculate", "arguments": {"expression": "( ( ( (', []
    assert example.plain_turn(tokenizer, prompt, cut, chat, MALFORMED_REPLY) is None
    assert chat[0] == {"role": "assistant", "content": cut}
    assert chat[1]["role"] == "tool" and chat[1]["content"].startswith("error: the tool call could not be read (")
    call, chat = '<tool_call>[{"name": "calculate", "arguments": {"expression": "2 + 3"}}]</tool_call>', []
    assert example.plain_turn(tokenizer, prompt, call, chat, MALFORMED_REPLY) is None
    assert chat[1] == {"role": "tool", "content": calculate(expression="2 + 3")}
    assert example.plain_turn(tokenizer, prompt, "<answer>5</answer>", [], MALFORMED_REPLY) == "<answer>5</answer>"
