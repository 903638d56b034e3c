"""`posttrain sft | rm | dpo | eval` from configs: errors before any model loads, and real runs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.recipes import DPORun, ModelSection, RewardModelRun, SFTRun, build_model_and_tokenizer

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["stpes=3"], "Did you mean 'steps'?"),
        (["steps=0"], "steps = 0: Input should be greater than or equal to 1"),
        (["steps=many"], "valid integer"),
        (["learning_rate=0"], "learning_rate = 0: Input should be greater than 0"),
        (["batch_size=-2"], "batch_size = -2"),
        (["gradient_accumulation=0"], "gradient_accumulation = 0"),
        (["lr_scheduler=cosin"], "'constant_with_warmup', 'cosine' or 'linear'"),
        (["warmup_steps=-1"], "warmup_steps = -1"),
        (["min_lr_ratio=2"], "min_lr_ratio = 2"),
        (["max_grad_norm=0"], "max_grad_norm = 0"),
        (["keep_last=0"], "keep_last = 0"),
        (["model.pth=x"], "Did you mean 'model.path'?"),
        (["model.dtype=fp8"], "'float32', 'bfloat16' or 'float16'"),
        (["model.tiny.arch=gpt2"], "'llama' or 'qwen2'"),
        (["model.tiny.layers=0"], "model.tiny.layers = 0"),
        (["model.tiny.tokenizer=bpe"], "model.tiny.tokenizer = 'bpe'"),
        (["model.lora.r=0"], "model.lora.r = 0"),
        (["model.lora.dropout=1.5"], "model.lora.dropout = 1.5"),
        (["data.tsk=reverse"], "Did you mean 'data.task'?"),
        (["data.format=chat"], "'prompt', 'prompt_completion', 'preference' or 'conversational'"),
        (["data.on_bad_row=ignore"], "'error' or 'skip'"),
        (["data.n_train=0"], "data.n_train = 0"),
        (["data.task=null"], "set data.path (a local file or folder) or data.task"),
        (["model.tiny=null"], "set model.path (a local model folder) or model.tiny"),
    ],
)
def test_invalid_sft_configs_are_refused_before_anything_loads(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(SFTRun, "configs/reverse_sft.yaml", overrides)
    assert expected in str(error.value)


@pytest.mark.parametrize(
    ("config_cls", "overrides", "expected"),
    [
        (DPORun, ["loss_type=kto"], "'sigmoid', 'ipo', 'hinge' or 'robust'"),
        (DPORun, ["label_smoothing=0.5"], "label_smoothing = 0.5"),
        (DPORun, ["beta=0"], "beta = 0"),
        (RewardModelRun, ["center_coef=-1"], "center_coef = -1"),
    ],
)
def test_invalid_preference_configs(config_cls, overrides, expected):
    base = ["model.tiny.layers=1", "data.task=preference"]
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        load_config(config_cls, None, base + overrides)


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_label_smoothing_is_refused_for_losses_that_do_not_use_it(loss_type):
    # ipo and hinge have no label-noise term: a nonzero ε used to be read and ignored
    base = ["model.tiny.layers=1", "data.task=preference", f"loss_type={loss_type}"]
    with pytest.raises(ConfigError) as error:
        load_config(DPORun, None, [*base, "label_smoothing=0.1"])
    message = str(error.value)
    assert "label_smoothing" in message and f"'{loss_type}'" in message
    assert "sigmoid" in message and "robust" in message
    assert load_config(DPORun, None, [*base, "label_smoothing=0"]).label_smoothing == 0


def test_tiny_models_take_model_dtype_and_gradient_checkpointing():
    # both were read and ignored for model.tiny: the model stayed float32 and stored activations
    spec = {"tiny": {"layers": 2, "hidden": 32, "heads": 2}}
    model, tokenizer = build_model_and_tokenizer(
        ModelSection(**spec, dtype="bfloat16", gradient_checkpointing=True), seed=0
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    calls: list[int] = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda *args: calls.append(1))
    model.train()
    ids = torch.tensor([tokenizer("abc")["input_ids"]])
    model(input_ids=ids).logits.float().sum().backward()
    assert len(calls) == 4  # the attention of each of the 2 layers ran again in the backward pass
    plain, _ = build_model_and_tokenizer(ModelSection(**spec), seed=0)
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    assert not plain.is_activation_checkpointing


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["sft", "--config", "configs/reverse_sft.yaml", "stpes=3"]) == 2
    assert "Did you mean 'steps'?" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_then_eval_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "sft"
    args = [
        "sft",
        "--config",
        "configs/reverse_sft.yaml",
        *TINY,
        "steps=6",
        "eval_every=0",
        "data.n_train=64",
        "data.n_eval=20",
        f"output_dir={out}",
    ]
    assert main(args) == 0
    assert (out / "config.yaml").is_file() and (out / "report.html").is_file()
    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss/sft" in r] == list(range(1, 7))
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "final"), "--task", "reverse", "--n", "20", "--k", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rows"] == 20 and 0 <= report["greedy_accuracy"] <= report["pass@2"] <= 1
    # resume continues where the checkpoint left off
    assert main([*args[:-1], f"output_dir={out}", "steps=8", "--resume", "auto"]) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss/sft" in r] == list(range(1, 9))


@pytest.mark.slow
def test_reward_model_and_dpo_from_the_command_line(tmp_path):
    common = [*TINY, "data.task=preference", "data.n_train=64", "data.n_eval=32", "steps=4", "batch_size=8"]
    assert main(["rm", *common, f"output_dir={tmp_path / 'rm'}"]) == 0
    scorer = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "final")
    assert scorer.config.num_labels == 1 and scorer.config.pad_token_id is not None
    assert "eval/pairwise_accuracy" in read_jsonl(tmp_path / "rm" / "metrics.jsonl")[-1]
    assert main(["dpo", *common, "model.lora.r=4", f"output_dir={tmp_path / 'dpo'}"]) == 0
    summary = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    assert summary["first_step"]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)  # LoRA B = 0: policy = reference


def test_a_data_file_of_the_wrong_kind_fails_at_load_time(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Reverse the name: sean. Answer:"}\n')
    capsys.readouterr()
    argv = ["sft", "--config", "configs/reverse_sft.yaml", *TINY, f"data.path={data}", f"output_dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain sft: ") and str(data) in err and "prompt" in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()
