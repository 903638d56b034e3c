"""Seed 000, example 2 (R1-Zero style): the shipped configs, a shortened SFT → GRPO run in
which the format reward must rise, and the same RL config on a local Qwen2 folder with its own
BPE tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import load_config
from posttrain.data.prompt_templates import R1_ZERO
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.recipes import SFTRun
from posttrain.train.rl_config import load_rl_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def load_example():
    spec = importlib.util.spec_from_file_location(
        "posttrain_example_math_r1_zero", ROOT / "examples" / "math_r1_zero.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_shipped_configs_validate_and_share_the_prompt():
    sft = load_config(SFTRun, CONFIGS / "math_sft.yaml")
    rl = load_rl_config(CONFIGS / "math_grpo.yaml")
    assert sft.data.task == rl.data.task == "arithmetic"
    assert sft.data.prompt_template == rl.data.prompt_template == "r1_zero"
    assert rl.model.path == f"{sft.output_dir}/final"
    assert rl.rewards == ["math", "format"]
    assert (rl.algorithm.preset, rl.algorithm.kl.placement, rl.algorithm.kl.estimator) == ("grpo", "loss", "k3")
    assert rl.algorithm.kl.coef > 0
    assert rl.sampling.stop == ["</answer>"]


def _local_qwen2_with_bpe(folder: Path) -> Path:
    """A random tiny Qwen2 and a byte-level BPE tokenizer trained here on the task's text, saved
    as a Hugging Face folder, standing in for a downloaded checkpoint."""
    from posttrain.data.tasks.arithmetic import split_problems
    from posttrain.models.chat import ensure_chat_template
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import train_bpe_tokenizer

    rows, _ = split_problems(300, 0, seed=1)
    texts = [R1_ZERO] * 20 + [f"{row['prompt']} {row['completion']}" for row in rows]
    tokenizer = ensure_chat_template(train_bpe_tokenizer(texts, vocab_size=400))
    model = build_tiny_causal_lm(len(tokenizer), arch="qwen2", layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_rl_config_runs_unchanged_on_a_local_qwen2_with_its_own_bpe_tokenizer(tmp_path, capsys):
    from posttrain.models.loading import load_tokenizer

    folder = _local_qwen2_with_bpe(tmp_path / "qwen2")
    out = tmp_path / "rl"
    overrides = [f"model.path={folder}", f"output_dir={out}", "steps=2", "prompts_per_step=2", "samples_per_prompt=2"]
    # random weights: neither reward varies yet, which the pre-flight check would stop
    overrides += ["max_new_tokens=8", "eval_size=4", "data.n_train=16", "data.n_eval=4", "preflight=false"]
    assert main(["rl", "--config", str(CONFIGS / "math_grpo.yaml"), *overrides]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "reward/format/mean" in r] == [1, 2]
    assert "loss/kl" in records[1] and "eval/format/mean" in records[0]
    tokenizer = load_tokenizer(out / "final")
    assert tokenizer.chat_template and len(tokenizer) == len(load_tokenizer(folder))
    prompt = read_jsonl(out / "samples.jsonl")[0]["prompt"]
    assert prompt.endswith(". Assistant:") and len(tokenizer(prompt)["input_ids"]) < len(prompt) / 2  # subwords
    capsys.readouterr()
    evaluate = ["eval", "--model", str(out / "final"), "--task", "arithmetic", "--n", "4", "--reward", "format"]
    evaluate.append("--json")  # the one line a script reads
    assert main([*evaluate, "--prompt-template", "r1_zero", "--stop", "</answer>", "--max-new-tokens", "8"]) == 0
    assert '"rows": 4' in capsys.readouterr().out


@pytest.mark.slow
def test_grpo_raises_the_format_reward_left_low_by_a_short_cold_start(tmp_path):
    summary = load_example().main(["--quick", "--output-dir", str(tmp_path)])
    first, last = summary["sampled_format"]  # means over 5 steps of 128 samples: ±0.03 by chance
    assert first < 0.6, summary  # the cold start leaves room
    assert last > first + 0.1, summary
    before, after = summary["greedy_format"]  # 50 held-out prompts; unchanged without learning
    assert after > before + 0.15, summary
    assert summary["response_length"][1] > 0
    report = (tmp_path / "grpo" / "report.html").read_text()
    assert (tmp_path / "grpo" / "math_r1_zero.png").is_file() and "math_r1_zero.png" in report
