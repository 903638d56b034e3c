"""The real-model recipe that gains answers (SmolLM2-135M-Instruct counting letters with GRPO and
LoRA): the whole script (measure the shipped model, GRPO, measure final/ loaded by plain
transformers, plain generate, summary, figure) runs end to end on a tiny local stand-in with its
own BPE tokenizer and chat template. The real runs are measured in the README, not here."""

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
    path = ROOT / "examples" / "smollm2_letters.py"
    spec = importlib.util.spec_from_file_location("posttrain_example_smollm2_letters", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_config_trains_adapters_on_letter_counting_from_the_shipped_model():
    config = load_rl_config(ROOT / "configs" / "smollm2_letters.yaml")
    assert config.data.task == "reasoning_gym:letter_counting" and config.model.path == "runs/smollm2/base"
    assert config.model.lora is not None and config.rewards == ["reasoning_gym", "format"]
    assert config.eval_size == 300 and config.data.n_eval >= config.eval_size and config.eval_k == 4
    assert (config.algorithm.kl.placement, config.algorithm.kl.estimator) == ("loss", "k3")


def test_right_answers_takes_full_marks_only():
    example = load_example()
    from posttrain.data.tasks import get_task

    row = get_task("reasoning_gym:letter_counting", {"min_words": 1, "max_words": 3})(0, 1, 3).held_out[0]
    answer = row["answer"]
    completions = [f"<answer>{answer}</answer>", f"<answer>{answer} times</answer>", "<answer>-1</answer>"]
    scores = example.right_answers([row["prompt"]] * 3, completions, None, **{k: [row[k]] * 3 for k in row})
    assert scores == [1.0, 0.0, 0.0]  # the task itself gives the second one partial credit


def _stand_in(folder: Path) -> None:
    from posttrain.data.tasks import get_task
    from posttrain.models.chat import ensure_chat_template
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import train_bpe_tokenizer

    rows = get_task("reasoning_gym:letter_counting")(40, 0, 5).train
    texts = [r["prompt"] + " <think> </think> <answer> </answer>" + r["answer"] for r in rows]
    tokenizer = ensure_chat_template(train_bpe_tokenizer(texts, vocab_size=400))
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer, max_positions=2048)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_the_recipe_runs_end_to_end_on_a_local_stand_in(tmp_path, capsys):
    example = load_example()
    _stand_in(tmp_path / "base")  # present, so the GGUF import is skipped
    rl = ["data.n_train=16", "data.n_eval=4", "eval_size=4", "steps=2", "prompts_per_step=2", "samples_per_prompt=2"]
    rl += ["micro_batch_size=2", "max_new_tokens=8", "eval_batch_size=3", "preflight=false", "eval_k=0"]
    summary = example.main(["--output-dir", str(tmp_path), "--seed", "1", "--rl", *rl])
    run = tmp_path / "letters-1"
    assert summary["eval_rows"] == 4
    for figures in (summary["shipped"], summary["after_rl"]):
        assert (4 * figures["greedy"]).is_integer() and (16 * figures["mean@4"]).is_integer()  # right answers
        assert set(figures) >= {"greedy_stderr", "mean@4_stderr", "pass@4", "answer_tag", "reworded_greedy"}
    answers = [row["answer"] for row in example.held_out(1, ["data.n_eval=4", "eval_size=4"])]
    assert summary["majority_answer_share"] == max(answers.count(a) for a in answers) / 4
    assert 1 <= summary["after_rl"]["distinct_greedy_answers"] <= 4
    assert summary["greedy_gain"]["gain"] == summary["after_rl"]["greedy"] - summary["shipped"]["greedy"]
    assert len(summary["plain_generate_examples"]) == 3
    assert all(isinstance(text, str) for text in summary["plain_generate_examples"])
    # final/ is a plain model folder (the adapters folded in), the one the measurement loaded
    assert (run / "grpo" / "final" / "config.json").exists()
    assert not (run / "grpo" / "final" / "adapter_config.json").exists()
    assert json.loads((run / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert "smollm2_letters.png" in (run / "grpo" / "report.html").read_text()
    # the reworded prompts are the same problems under other words
    rows = example.held_out(1, ["data.n_eval=4", "eval_size=4"])
    reworded = example.held_out(1, ["data.n_eval=4", "eval_size=4"], example.REWORDED)
    assert [r["answer"] for r in rows] == [r["answer"] for r in reworded]
    assert "Count carefully" in str(reworded[0]["prompt"]) and "Count carefully" not in str(rows[0]["prompt"])
    # a second run reads every finished stage back instead of training again
    metrics = (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    again = example.main(["--output-dir", str(tmp_path), "--seed", "1", "--rl", *rl])
    assert again["after_rl"] == summary["after_rl"] and (run / "grpo" / "metrics.jsonl").stat().st_mtime_ns == metrics
    out = capsys.readouterr().out
    stages = [line.split()[1] for line in out.splitlines() if line.startswith("[smollm2] ") and "warning" not in line]
    assert stages == ["shipped", "rl", "trained", "plain_generate"]
    # a policy no better than always giving the commonest answer is called out
    prior = summary["majority_answer_share"] + 2 * summary["after_rl"]["greedy_stderr"]
    assert ("[smollm2] warning: greedy accuracy after RL" in out) == (summary["after_rl"]["greedy"] <= prior)
