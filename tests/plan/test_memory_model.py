"""The memory plan's parts are the tensors a run really holds: the parameter counts of real
models (tied or not, LoRA's adapters), the engine's KV cache, the activations autograd keeps
(counted with saved-tensor hooks); ``--plan`` prints the phases and exits without training, and
a run that cannot fit is refused before anything loads, naming what to lower. How close the
whole peak comes to measured runs is a benchmark (benchmarks/memory_plan.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain.cli import main
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.plan.memory_model import ModelShape, human
from posttrain.plan.plan import model_shape
from posttrain.rollout.products import can_pack
from posttrain.train.rl_config import load_rl_config

TOKENIZER = build_char_tokenizer()


def tiny(arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, intermediate: int | None = None):
    config = load_rl_config(
        None,
        [f"model.tiny={{arch: {arch}, layers: {layers}, hidden: {hidden}, heads: {heads}"
         + (f", intermediate: {intermediate}" if intermediate else "") + "}", "data.task=reverse"],
    )  # fmt: skip
    model = build_tiny_causal_lm(
        len(TOKENIZER), arch=arch, layers=layers, hidden=hidden, heads=heads, intermediate=intermediate,
        max_positions=2048, seed=0, tokenizer=TOKENIZER,
    )  # fmt: skip
    return model_shape(config.model), model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parameter_counts_are_the_built_models(arch):
    shape, model = tiny(arch, layers=3, hidden=96, heads=6, intermediate=200)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())


def test_a_tied_real_config_counts_its_embeddings_once():
    from transformers import AutoModelForCausalLM, LlamaConfig

    settings = dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**settings))
    shape = ModelShape.from_config(settings)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())  # SmolLM2-135M's 134.5M


def test_lora_parameters_are_peft_s_trainable_ones():
    from peft import LoraConfig, get_peft_model

    shape, model = tiny("llama", layers=2, hidden=64, heads=4)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shape.lora_parameters(8) == trainable


def test_the_kv_cache_is_the_engine_s():
    from posttrain.rollout.native import NativeDecoder

    shape, model = tiny("llama", layers=2, hidden=64, heads=4)
    decoder = NativeDecoder(model)
    prompts = torch.randint(5, 40, (3, 7))
    with torch.inference_mode():
        decoder.prefill(prompts, torch.ones_like(prompts), max_new_tokens=5, repeats=2)
    held = decoder.keys.untyped_storage().nbytes() + decoder.values.untyped_storage().nbytes()
    assert shape.kv_cache(rows=6, positions=7 + 5, nbytes=4) == held


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="this PyTorch has no MKL (aarch64 wheels)")
def test_the_engine_packs_are_the_weights_the_engine_packs(monkeypatch):
    from posttrain.rollout import native

    shape, model = tiny("llama", layers=2, hidden=64, heads=4)
    decoder = native.NativeDecoder(model)
    decoder.products.packing = True  # made from hidden 512 on; the plan's formula is the same
    monkeypatch.setattr(native, "PACK_FROM_ROW_STEPS", 0)
    prompts = torch.randint(5, 40, (3, 7))
    with torch.inference_mode():
        decoder.prefill(prompts, torch.ones_like(prompts), max_new_tokens=5, repeats=2)
        decoder.decode(torch.randint(5, 40, (6,)))
    assert decoder.products.rows == 6
    assert shape.engine_packs() == decoder.products.packed_bytes()


def _saved_bytes(model: torch.nn.Module, rows: int, length: int) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of a log-prob forward (the
    parameters and the output layer's logits left out: the plan counts them apart)."""
    from posttrain.models.logprobs import response_logprobs

    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(5, 40, (rows, length))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        response_logprobs(model, ids, torch.ones_like(ids), length - 1)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in storages.items() if pointer not in parameters)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_saved_activations_are_what_autograd_keeps(arch):
    shape, model = tiny(arch, layers=3, hidden=128, heads=4, intermediate=320)
    rows, length = 4, 48
    measured = _saved_bytes(model, rows, length)
    planned = shape.saved_activations(rows * length, 4, checkpointing=False)
    assert planned == pytest.approx(measured, rel=0.1)


def test_plan_prints_the_phases_and_trains_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["rl", "--config", "posttrain/demo_rl.yaml", "model.tiny.layers=1", f"output_dir={out}", "--plan"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for phase in ("resident", "generation", "evaluation", "update"):
        assert f"  {phase} " in printed
    assert "peak" in printed and "in the update" in printed
    assert not out.exists()  # nothing written, nothing loaded


def test_a_multi_turn_plan_holds_the_turn_the_engine_keeps_beside_the_next(tmp_path, capsys):
    """While more turns may follow, the engine keeps each row's keys and values for the next
    turn (rollout/turn_cache.py): generation holds them beside the next turn's cache."""
    base = ["rl", "--config", "posttrain/demo_rl.yaml", "model.tiny.layers=1", "data.task=support_bot",
            "env.name=support_bot", f"output_dir={tmp_path / 'run'}", "--plan"]  # fmt: skip
    assert main([*base, "env.max_turns=3"]) == 0
    generation = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  generation "))
    cache = generation.split("KV cache ")[1].split(",")[0]
    assert f"kept turn {cache}" in generation  # the same rows and length as the cache
    assert main([*base, "env.max_turns=1"]) == 0
    assert "kept turn" not in capsys.readouterr().out  # one turn: nothing is kept


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="this PyTorch has no MKL (aarch64 wheels)")
def test_a_cpu_plan_holds_the_packs_where_the_engine_makes_them(tmp_path, capsys, monkeypatch):
    """From hidden size 512 the native engine packs the weights it decodes with on a CPU
    (rollout/products.py): generation and evaluation hold the packs, while they are a small share of memory."""
    from posttrain.rollout import products

    base = ["rl", "--config", "posttrain/demo_rl.yaml", "model.tiny.layers=1", "device=cpu", "--plan",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip

    def generation_lines(*overrides: str) -> list[str]:
        assert main([*base, *overrides]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith(("  generation ", "  eval"))]

    wide = generation_lines("model.tiny.hidden=512", "model.tiny.heads=8")
    shape = model_shape(
        load_rl_config("posttrain/demo_rl.yaml", ["model.tiny.layers=1", "model.tiny.hidden=512"]).model
    )
    assert len(wide) == 2 and all(f"engine packs {human(shape.engine_packs())}" in line for line in wide)
    assert not any("engine packs" in line for line in generation_lines())  # 128 wide: its weights sit in cache
    monkeypatch.setattr(products, "PACKS_SHARE_OF_MEMORY", shape.engine_packs() / 2**50)  # a machine too small
    assert not any("engine packs" in line for line in generation_lines("model.tiny.hidden=512", "model.tiny.heads=8"))


def test_sft_plan_has_its_training_step_and_evaluation(tmp_path, capsys):
    args = ["sft", "--config", "configs/reverse_sft.yaml", f"output_dir={tmp_path / 'sft'}", "--plan"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "  training step " in printed and "  evaluation " in printed and "  peak " in printed


def test_a_run_that_cannot_fit_is_refused_before_anything_loads(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "rl", "--config", "posttrain/demo_rl.yaml", "model.tiny.layers=8", f"output_dir={out}",
        "prompts_per_step=1024", "max_new_tokens=2000", "memory_gib=16",
    ]  # fmt: skip
    assert main(args) == 2
    error = capsys.readouterr().err
    # the update's micro-batch is sized to fit; the KV cache of 8192 sequences of 2000 tokens cannot be
    assert "at its peak (the generation)" in error and "prompts_per_step" in error
    assert "Traceback" not in error
    assert not out.exists()


def other_families():
    """GPT-2's and Bloom's configs name their sizes otherwise (n_embd, n_head, n_layer)."""
    from transformers import BloomConfig, GPT2Config

    vocab = len(TOKENIZER)
    return {
        "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=256),
        "bloom": BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=vocab),
    }


@pytest.mark.parametrize("family", ["gpt2", "bloom"])
def test_a_model_of_another_family_is_sized_through_its_config(tmp_path, capsys, family):
    """Hardening 3, item 11: the plan read config.json's raw keys, so every GPT-2- or Bloom-family
    model stopped before training with KeyError: 'hidden_size'."""
    from transformers import AutoModelForCausalLM

    config = other_families()[family]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / family)
    TOKENIZER.save_pretrained(tmp_path / family)
    shape = ModelShape.from_config(config)
    assert (shape.vocab, shape.hidden, shape.layers, shape.heads, shape.kv_heads) == (len(TOKENIZER), 32, 2, 4, 4)
    args = ["sft", f"model.path={tmp_path / family}", "data.task=reverse", "data.n_train=32", "data.n_eval=9"]
    assert main([*args, "batch_size=4", f"output_dir={tmp_path / 'run'}", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "[sft] memory plan (estimated from the shapes):" in out and "peak" in out


@pytest.mark.parametrize("config", [{}, {"hidden_size": 32, "vocab_size": 9, "num_hidden_layers": "2"}])
def test_a_config_without_a_decoders_sizes_is_named_not_a_crash(config):
    from posttrain.plan.memory_model import ShapeUnknown

    with pytest.raises(ShapeUnknown, match="num_attention_heads"):
        ModelShape.from_config(config)
