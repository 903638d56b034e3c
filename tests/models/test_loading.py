"""Loading local folders as a user would: by path, with plain transformers and with posttrain."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from posttrain.models.loading import ModelLoadError, ensure_pad_token, load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model.eval(), tokenizer


def test_load_by_path_like_plain_transformers_and_generate(saved):
    folder, model, _ = saved
    ours, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    plain, plain_tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(plain) and ours.dtype == torch.float32
    ids = tokenizer(["Reverse: ab"], return_tensors="pt")["input_ids"]
    assert ids.tolist() == plain_tokenizer(["Reverse: ab"], return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=0, rtol=0)
        out = ours.generate(ids, max_new_tokens=4, do_sample=False)
        expected = plain.eval().generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1] and torch.equal(out, expected)
    assert isinstance(tokenizer.decode(out[0]), str)


def test_dtype_and_gradient_checkpointing(saved):
    folder, _, _ = saved
    assert load_causal_lm(folder, dtype="bfloat16").dtype == torch.bfloat16
    assert load_causal_lm(folder, dtype="auto").dtype == torch.float32  # what config.json records
    model = load_causal_lm(folder, gradient_checkpointing=True).train()
    assert model.is_activation_checkpointing and model.config.use_cache is False
    ids = torch.tensor([[5, 6, 7, 8]])
    model(ids, labels=ids).loss.backward()  # recomputation works with the non-reentrant variant
    # the same gradients as without checkpointing, down to the first layer
    plain = load_causal_lm(folder).train()
    plain(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_causal_lm(folder, dtype="fp8")


def test_missing_folder_file_and_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=f"does not exist \\(looked for {tmp_path / 'nope'}\\)"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "weights.bin").write_text("x")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json \(found: checkpoints/, weights\.bin\)"):
        load_causal_lm(tmp_path)
    with pytest.raises(ModelLoadError, match="is a file"):
        load_causal_lm(tmp_path / "weights.bin")


def test_unknown_architecture_names_the_path_and_what_was_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "wobble", "architectures": ["WobbleForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"unknown architecture.*'wobble'.*WobbleForCausalLM") as error:
        load_causal_lm(tmp_path)
    assert str(tmp_path) in str(error.value)
    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads((tmp_path / "config.json").read_text()), "auto_map": {}})
    )
    with pytest.raises(ModelLoadError, match="trust_remote_code=True"):
        load_causal_lm(tmp_path)
    # known to transformers, but an encoder-decoder: no AutoModelForCausalLM class
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})
    )
    with pytest.raises(ModelLoadError, match=r"unknown architecture for AutoModelForCausalLM: model_type 't5'"):
        load_causal_lm(tmp_path)


def test_config_without_weights_and_adapter_folder(tmp_path, saved):
    folder, _, _ = saved
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"config\.json but no weights"):
        load_causal_lm(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    with pytest.raises(ModelLoadError, match=r"LoRA adapter .*'/models/base'"):
        load_causal_lm(adapter)


def test_tokenizer_without_pad_reuses_eos_and_says_so(tmp_path, caplog):
    source = build_char_tokenizer()
    no_pad = PreTrainedTokenizerFast(tokenizer_object=source.backend_tokenizer, eos_token="<eos>")
    no_pad.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="posttrain.models.loading"):
        tokenizer = load_tokenizer(tmp_path, padding_side="left")
    assert tokenizer.pad_token == "<eos>" and tokenizer.pad_token_id == source.eos_token_id
    assert "no pad token; using EOS '<eos>'" in caplog.text
    assert tokenizer(["a", "abc"], padding=True)["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2  # left
    assert load_tokenizer(tmp_path, padding_side="right")(["a", "abc"], padding=True)["attention_mask"][0] == [1, 0, 0]
    with pytest.raises(ModelLoadError, match="neither a pad nor an EOS"):
        ensure_pad_token(PreTrainedTokenizerFast(tokenizer_object=source.backend_tokenizer))
    with pytest.raises(ModelLoadError, match="padding_side"):
        load_tokenizer(tmp_path, padding_side="middle")


def test_folder_without_tokenizer_files(tmp_path, saved):
    folder, _, _ = saved
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"holds no tokenizer .*found: config\.json"):
        load_tokenizer(tmp_path)


def test_a_run_output_that_is_not_there_says_which_run_writes_it(tmp_path, monkeypatch, capsys):
    """A newcomer's first hour, item 8: docs/training.md's RL commands start from runs/demo/sft/final,
    which only `make demo` writes; on a fresh clone the message said only that it does not exist."""
    from posttrain.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["rl", "--config", str(ROOT / "configs" / "reverse_grpo.yaml"), "model.path=runs/demo/sft/final"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "make demo" in err and "Traceback" not in err, err
