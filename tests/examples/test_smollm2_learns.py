"""The real-model recipe (SmolLM2-135M-Instruct on basic arithmetic: self-distilled SFT, then GRPO
with LoRA over a curriculum): the whole script (measure the shipped model, sample it and keep its
right answers as SFT rows, SFT, measure, GRPO, measure final/ loaded by plain transformers, plain
generate, summary, figure) runs end to end on a tiny local stand-in with its own BPE tokenizer and
chat template; so does the letters variant without SFT. The real runs are measured in docs/real-models.md."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from posttrain.train.rl_config import load_rl_config

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install 'posttrain[tasks]'")

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    path = ROOT / "examples" / "smollm2_learns.py"
    spec = importlib.util.spec_from_file_location("posttrain_example_smollm2_learns", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_configs_train_adapters_with_a_kl_to_the_start():
    letters = load_rl_config(ROOT / "configs" / "smollm2_letters.yaml")
    assert letters.data.task == "reasoning_gym:letter_counting" and letters.model.path == "runs/smollm2/base"
    arithmetic = load_rl_config(ROOT / "configs" / "smollm2_arithmetic.yaml")
    assert arithmetic.data.task == "reasoning_gym:basic_arithmetic" and arithmetic.data.curriculum is not None
    assert arithmetic.model.path == "runs/smollm2/arithmetic-0/sft/final" and arithmetic.eval_k == 0
    for config in (letters, arithmetic):
        assert config.model.lora is not None and config.rewards == ["reasoning_gym", "format"]
        assert config.eval_size == 300 and config.data.n_eval >= config.eval_size
        assert (config.algorithm.kl.placement, config.algorithm.kl.estimator) == ("loss", "k3")


def test_right_answers_takes_full_marks_only():
    example = load_example()
    from posttrain.data.tasks import get_task

    row = get_task("reasoning_gym:letter_counting", {"min_words": 1, "max_words": 3})(0, 1, 3).held_out[0]
    answer = row["answer"]
    completions = [f"<answer>{answer}</answer>", f"<answer>{answer} times</answer>", "<answer>-1</answer>"]
    scores = example.right_answers([row["prompt"]] * 3, completions, None, **{k: [row[k]] * 3 for k in row})
    assert scores == [1.0, 0.0, 0.0]  # the task itself gives the second one partial credit


def test_sft_rows_keep_the_shortest_right_samples_in_the_trained_format():
    example = load_example()
    problem = {"prompt": "Calculate 3 + 5.", "answer": "8"}
    samples = [
        "3 plus 5 is, after much thought about dice, 8",
        " 3 + 5 = 8 ",
        "<answer>8</answer>",
        "3 + 5 = 9",
        "3 + 5 = 8",
    ]
    right = [1.0, 1.0, 1.0, 0.0, 1.0]
    rows = example.sft_rows(problem, samples, right, keep=2)
    # distinct texts (stripped), right ones only, tag-free, shortest first
    assert rows == [
        {"prompt": "Calculate 3 + 5.", "completion": "<think> 3 + 5 = 8 </think><answer> 8 </answer>"},
        {
            "prompt": "Calculate 3 + 5.",
            "completion": "<think> 3 plus 5 is, after much thought about dice, 8 </think><answer> 8 </answer>",
        },
    ]
    assert example.sft_rows(problem, samples, [0.0] * 5, keep=2) == []


def _stand_in(folder: Path, task: str, options: dict | None = None) -> None:
    from posttrain.data.tasks import get_task
    from posttrain.models.chat import ensure_chat_template
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import train_bpe_tokenizer

    rows = get_task(task, options or {})(40, 0, 5).train
    texts = [r["prompt"] + " <think> </think> <answer> </answer>" + r["answer"] for r in rows]
    tokenizer = ensure_chat_template(train_bpe_tokenizer(texts, vocab_size=400))
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer, max_positions=2048)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


SMALL_RL = ["data.n_train=16", "data.n_eval=4", "eval_size=4", "steps=2", "prompts_per_step=2", "samples_per_prompt=2"]
SMALL_RL += ["micro_batch_size=2", "max_new_tokens=8", "eval_batch_size=3", "preflight=false", "eval_k=0"]


def test_the_arithmetic_recipe_distills_right_samples_then_runs_grpo(tmp_path, capsys):
    example = load_example()
    _stand_in(tmp_path / "base", "reasoning_gym:basic_arithmetic", {"max_terms": 2, "max_digits": 1})
    sft = ["steps=2", "batch_size=1", "gradient_accumulation=1", "warmup_steps=0"]
    argv = ["--output-dir", str(tmp_path), "--seed", "1", "--distill-prompts", "24", "--distill-k", "8"]
    argv += ["--distill-temperature", "1.0", "--distill-keep", "2"]  # a random stand-in is rarely right
    summary = example.main([*argv, "--rl", *SMALL_RL, "--sft", *sft])
    run = tmp_path / "arithmetic-1"
    stages = json.loads((run / "stages.json").read_text())
    assert list(stages) == [
        "settings",
        "shipped",
        "self_distill",
        "sft",
        "after_sft",
        "rl",
        "trained",
        "plain_generate",
    ]
    # the SFT rows: each a right sample of the model's own, wrapped in the trained format
    distilled = stages["self_distill"]["result"]
    rows = [json.loads(line) for line in (run / "self_distilled.jsonl").read_text().splitlines()]
    assert distilled["sampled"] == 24 * 8 and 1 <= distilled["rows"] == len(rows) <= 2 * 24
    for row in rows:
        assert row["completion"].startswith("<think> ") and row["completion"].endswith(" </answer>")
        assert "Calculate" in row["prompt"] and "<think>" not in row["prompt"]  # the raw problem: SFT templates it
    # RL starts from the SFT model: its measurement is the baseline of RL's own share
    assert summary["after_sft"] is not None and (run / "sft" / "final" / "config.json").exists()
    rl_config = (run / "grpo" / "config.yaml").read_text()
    assert str(run / "sft" / "final") in rl_config
    assert summary["rl_greedy_gain"]["gain"] == summary["after_rl"]["greedy"] - summary["after_sft"]["greedy"]
    assert summary["greedy_gain"]["gain"] == summary["after_rl"]["greedy"] - summary["shipped"]["greedy"]
    assert (run / "grpo" / "final" / "config.json").exists()
    assert not (run / "grpo" / "final" / "adapter_config.json").exists()
    # the reworded prompts are the same problems under other words
    config = example.CONFIGS / "smollm2_arithmetic.yaml"
    held = example.held_out(config, 1, ["data.n_eval=4", "eval_size=4"])
    reworded = example.held_out(config, 1, ["data.n_eval=4", "eval_size=4"], example.REWORDED)
    assert [r["answer"] for r in held] == [r["answer"] for r in reworded]
    assert "Work it out" in str(reworded[0]["prompt"]) and "Work it out" not in str(held[0]["prompt"])


def test_the_letters_recipe_without_sft_runs_end_to_end(tmp_path, capsys):
    example = load_example()
    _stand_in(tmp_path / "base", "reasoning_gym:letter_counting")  # present, so the GGUF import is skipped
    config = example.CONFIGS / "smollm2_letters.yaml"
    argv = ["--output-dir", str(tmp_path), "--seed", "1", "--config", str(config), "--no-sft", "--rl", *SMALL_RL]
    summary = example.main(argv)
    run = tmp_path / "letters-1"
    assert summary["eval_rows"] == 4 and summary["after_sft"] is None
    for figures in (summary["shipped"], summary["after_rl"]):
        assert (4 * figures["greedy"]).is_integer() and (16 * figures["mean@4"]).is_integer()  # right answers
        assert set(figures) >= {"greedy_stderr", "mean@4_stderr", "pass@4", "answer_tag", "reworded_greedy"}
    answers = [row["answer"] for row in example.held_out(config, 1, ["data.n_eval=4", "eval_size=4"])]
    assert summary["majority_answer_share"] == max(answers.count(a) for a in answers) / 4
    assert 1 <= summary["after_rl"]["distinct_greedy_answers"] <= 4
    assert summary["rl_greedy_gain"] == summary["greedy_gain"]  # RL started from the shipped model
    assert len(summary["plain_generate_examples"]) == 3
    assert all(isinstance(text, str) for text in summary["plain_generate_examples"])
    # final/ is a plain model folder (the adapters folded in), the one the measurement loaded
    assert (run / "grpo" / "final" / "config.json").exists()
    assert json.loads((run / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert "smollm2_learns.png" in (run / "grpo" / "report.html").read_text()
    # a second run reads every finished stage back instead of training again
    metrics = (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    again = example.main(argv)
    assert again["after_rl"] == summary["after_rl"] and (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns == metrics
    out = capsys.readouterr().out
    stages = [line.split()[1] for line in out.splitlines() if line.startswith("[smollm2] ") and "warning" not in line]
    assert stages == ["settings", "shipped", "rl", "trained", "plain_generate"]
    # a ledger written for other settings is refused, not reused; --fresh redoes it
    with pytest.raises(SystemExit, match="other settings or other problems"):
        example.main([*argv, "--reworded", "{prompt}\nAnswer in <answer> </answer>."])
    assert (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns == metrics
    # a policy no better than always giving the commonest answer is called out
    prior = summary["majority_answer_share"] + 2 * summary["after_rl"]["greedy_stderr"]
    assert ("[smollm2] warning: greedy accuracy after RL" in out) == (summary["after_rl"]["greedy"] <= prior)
