"""The real-model example (SmolLM2-135M-Instruct on gsm_symbolic): its two configs agree with
each other, and the whole script (base evaluation, LoRA SFT, LoRA GRPO, summary, figure) runs
end to end on a tiny local stand-in with its own BPE tokenizer and chat template. The real
30-minute run is measured in docs/real-models.md, not here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.recipes import SFTRun
from posttrain.train.rl_config import load_rl_config

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install 'posttrain[tasks]'")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def load_example():
    spec = importlib.util.spec_from_file_location("posttrain_example_smollm2_gsm", ROOT / "examples" / "smollm2_gsm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_configs_share_data_and_prompt_and_train_adapters():
    sft = load_config(SFTRun, CONFIGS / "smollm2_gsm_sft.yaml")
    rl = load_rl_config(CONFIGS / "smollm2_gsm.yaml")
    assert sft.data.task == rl.data.task == "reasoning_gym:gsm_symbolic"
    assert sft.data.prompt_template == rl.data.prompt_template and "<answer>" in rl.data.prompt_template
    assert sft.data.chat_template and rl.data.chat_template
    assert sft.model.lora is not None and rl.model.lora is not None
    assert rl.model.path == f"{sft.output_dir}/final"
    assert rl.rewards == ["reasoning_gym", "format"]
    assert (rl.algorithm.kl.placement, rl.algorithm.kl.estimator) == ("loss", "k3") and rl.algorithm.kl.coef > 0
    assert rl.eval_size == 200 and rl.data.n_eval >= rl.eval_size


def _stand_in(folder: Path) -> Path:
    """A random tiny Llama with a BPE tokenizer trained here on gsm_symbolic text and
    posttrain's default chat template: the shape of the real checkpoint, in a second."""
    from posttrain.data.tasks import get_task
    from posttrain.models.chat import ensure_chat_template
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import train_bpe_tokenizer

    rows = get_task("reasoning_gym:gsm_symbolic")(40, 0, 5).train
    tokenizer = ensure_chat_template(train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], vocab_size=500))
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer, max_positions=2048)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_example_runs_end_to_end_on_a_local_stand_in(tmp_path, capsys):
    example = load_example()
    _stand_in(tmp_path / "base")  # present, so the GGUF import is skipped
    small = ["data.n_train=16", "data.n_eval=4"]
    sft = ["steps=2", "batch_size=4", "gradient_accumulation=2", *small]
    rl = ["steps=2", "prompts_per_step=2", "samples_per_prompt=2", "micro_batch_size=2", "max_new_tokens=8"]
    rl += ["eval_size=4", "eval_batch_size=3", "preflight=false", *small]  # random weights: constant rewards
    summary = example.main(["--output-dir", str(tmp_path), "--sft", *sft, "--rl", *rl])
    # the base model's figures are the ones its evaluation stage recorded (a rerun reads them back)
    stage = json.loads((tmp_path / "stages.json").read_text())["eval_base"]
    assert summary["eval_rows"] == stage["rows"] == 4
    assert (summary["greedy_accuracy_base"], summary["greedy_format_base"]) == (stage["accuracy"], stage["format"])
    assert (4 * summary["greedy_accuracy_base"]).is_integer()  # solved problems of 4, not a mean score
    assert set(summary["rl_step_s"]) == {"generate", "reward", "prepare", "train", "step"}
    assert summary["rl_steps"] == 2 and summary["peak_rss_gb"] > 0
    # the SFT model is a plain folder (adapters folded in) that the RL stage loaded
    assert (tmp_path / "sft" / "final" / "config.json").exists()
    assert not (tmp_path / "sft" / "final" / "adapter_config.json").exists()
    assert (tmp_path / "sft" / "final" / "adapter" / "adapter_config.json").exists()  # also kept alone
    records = read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
    assert any("kl/ref" in r for r in records)
    sample = read_jsonl(tmp_path / "grpo" / "samples.jsonl")[0]
    assert "'role': 'user'" in sample["prompt"] and "<answer>" in sample["prompt"]  # a chat turn
    assert json.loads((tmp_path / "grpo" / "summary.json").read_text())["rl_steps"] == 2
    assert "smollm2_gsm.png" in (tmp_path / "grpo" / "report.html").read_text()
    capsys.readouterr()
