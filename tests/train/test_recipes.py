"""`posttrain sft | rm | dpo | eval` from configs: errors before any model loads, and real runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.data.tasks import get_task
from posttrain.data.tasks.reverse import reverse_reward
from posttrain.evaluate import evaluate, pass_at_k, sampled_eval
from posttrain.run.checkpoint import latest_checkpoint
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.preference import DPOObjective
from posttrain.train.recipes import (
    DPORun,
    ModelSection,
    RewardModelRun,
    SFTRun,
    build_model_and_tokenizer,
    run_dpo,
    run_sft,
)
from posttrain.train.sft import SFTObjective, collate, sft_batch_loss

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
        (["data.format=chat"], "'prompt', 'prompt_completion', 'preference', 'conversational' or 'episode'"),
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
    # final/ holds the weights of the last step (its checkpoint), not the initial ones
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    last = AutoModelForCausalLM.from_pretrained(latest_checkpoint(out).path).state_dict()
    assert latest_checkpoint(out).step == 6
    assert all(torch.equal(tensor, last[name]) for name, tensor in final.state_dict().items())
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss/sft" in r] == list(range(1, 7))
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "final"), "--task", "reverse", "--n", "20", "--k", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the command's numbers are those of the library's evaluation of that folder on the task's rows
    rows = get_task("reverse")(1, 20, 0).held_out
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    greedy = evaluate(final.eval(), tokenizer, rows, reverse_reward, max_new_tokens=16)
    sampled = sampled_eval(final, tokenizer, rows, reverse_reward, k=2, max_new_tokens=16, seed=0)
    assert report == {
        "task": "reverse",
        "rows": 20,
        "greedy_accuracy": greedy.accuracy,
        "greedy_accuracy_stderr": greedy.stderr,
        "pass@2": sampled.pass_at_k,
        "mean@2": sampled.mean_at_k,
        "mean@2_stderr": sampled.mean_at_k_stderr,
    }
    assert sampled.pass_at_k == pass_at_k(final, tokenizer, rows, reverse_reward, k=2, max_new_tokens=16, seed=0)
    greedy = greedy.accuracy
    # and the run's own last evaluation (the same 20 held-out names) saw the same greedy accuracy
    assert records[-1]["eval/accuracy"] == greedy
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


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


NAMES = ["sean", "joe", "akshita", "al", "mira", "tomas", "ines", "bo"]


def test_sft_evaluates_the_loss_on_data_eval_path_every_eval_every_steps(tmp_path):
    # data.eval_path and eval_every were read and ignored for a data file (only tasks evaluated)
    rows = [{"prompt": f"Reverse: {n}. Answer:", "completion": f" {n[::-1]}."} for n in NAMES]
    train, held = _write_jsonl(tmp_path / "t.jsonl", rows[:6]), _write_jsonl(tmp_path / "e.jsonl", rows[6:])
    common = [*TINY, f"data.path={train}", f"data.eval_path={held}", "batch_size=2", "warmup_steps=0"]
    history = run_sft(load_config(SFTRun, None, [*common, "steps=4", "eval_every=2", f"output_dir={tmp_path / 'a'}"]))
    records = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    losses = {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}
    assert sorted(losses) == [0, 2, 4]
    # step 0: the mean token NLL of the untrained model on the two held-out rows, computed here
    model, tokenizer = build_model_and_tokenizer(ModelSection(tiny={"layers": 1, "hidden": 32, "heads": 2}), seed=0)
    objective = SFTObjective(model, tokenizer)
    batch = collate([objective.encode(row) for row in rows[6:]], tokenizer.pad_token_id)
    with torch.no_grad():
        assert losses[0] == pytest.approx(float(sft_batch_loss(model.eval(), batch)), rel=1e-5)
    assert losses[4] < losses[0] and history[-1]["eval/loss"] == losses[4]
    # without eval_every: before and after training only
    run_sft(load_config(SFTRun, None, [*common, "steps=3", "eval_every=0", f"output_dir={tmp_path / 'b'}"]))
    steps = [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "eval/loss" in r]
    assert steps == [0, 3]


def test_dpo_evaluates_on_data_eval_path(tmp_path):
    # data.eval_path was read and ignored by dpo
    rows = [{"prompt": f"Reverse: {n}. Answer:", "chosen": f" {n[::-1]}.", "rejected": f" {n}."} for n in NAMES]
    train, held = _write_jsonl(tmp_path / "t.jsonl", rows[:6]), _write_jsonl(tmp_path / "e.jsonl", rows[6:])
    overrides = [*TINY, f"data.path={train}", f"data.eval_path={held}", "batch_size=2", "warmup_steps=0"]
    overrides += ["steps=4", "eval_every=2", "learning_rate=3e-3", f"output_dir={tmp_path / 'dpo'}"]
    run_dpo(load_config(DPORun, None, overrides))
    evals = {r["step"]: r for r in read_jsonl(tmp_path / "dpo" / "metrics.jsonl") if "eval/loss" in r}
    assert sorted(evals) == [0, 2, 4]
    # before training the policy is the reference: every margin is 0 and the loss is log 2
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[0]["eval/margin"] == pytest.approx(0.0, abs=1e-6)
    # after training: the trained model's DPO loss against the initial one on the held-out pairs
    reference, tokenizer = build_model_and_tokenizer(ModelSection(tiny={"layers": 1, "hidden": 32, "heads": 2}), 0)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "dpo" / "final").eval()
    objective = DPOObjective(trained, tokenizer, reference=reference.eval())
    with torch.no_grad():
        loss, metrics = objective.loss([objective.encode(row) for row in rows[6:]], 2.0)
    assert abs(evals[4]["eval/margin"]) > 1e-4
    assert evals[4]["eval/loss"] == pytest.approx(float(loss), rel=1e-5)
    assert evals[4]["eval/margin"] == pytest.approx(metrics["dpo/margin"], rel=1e-5)
    assert evals[4]["eval/accuracy"] == metrics["dpo/accuracy"]


def test_a_data_file_of_the_wrong_kind_fails_at_load_time(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Reverse the name: sean. Answer:"}\n')
    capsys.readouterr()
    argv = ["sft", "--config", "configs/reverse_sft.yaml", *TINY, f"data.path={data}", f"output_dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain sft: ") and str(data) in err and "prompt" in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()
