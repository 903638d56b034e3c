"""The weights an inference engine (vLLM) is sent: checkpoint names, LoRA folded in, the training
model left as it is; and the folder vLLM starts from loads with plain transformers."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.lora import apply_lora
from posttrain.rollout.weights import inference_weights, save_inference_folder, unmergeable_reason
from tests.rollout.conftest import tiny_model
from tests.rollout.test_native_lora import forward_logits, lora_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
MASK = torch.ones_like(IDS)


def test_a_plain_model_is_sent_as_its_own_tensors(tokenizer):
    model = tiny_model(tokenizer)
    weights = inference_weights(model)
    assert weights.keys() == model.state_dict().keys()
    assert all(weights[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())  # no copy


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_lora_model_is_sent_as_the_plain_model_it_computes(tokenizer, arch):
    model = lora_model(tokenizer, arch)
    plain = tiny_model(tokenizer, arch)
    weights = inference_weights(model)
    assert weights.keys() == plain.state_dict().keys()  # plain names: no base_layer, no lora_A/B
    plain.load_state_dict(weights)
    torch.testing.assert_close(forward_logits(plain, IDS, MASK), forward_logits(model, IDS, MASK), atol=1e-5, rtol=0)
    # the adapters matter (B is random), and the training model is not merged
    base_logits = forward_logits(tiny_model(tokenizer, arch), IDS, MASK)
    assert (base_logits - forward_logits(model, IDS, MASK)).abs().max() > 1e-3
    assert not any(getattr(module, "merged", False) for module in model.modules())


def test_disabled_adapters_send_the_base_weights(tokenizer):
    model = lora_model(tokenizer)
    with model.disable_adapter():
        weights = inference_weights(model)
    base = tiny_model(tokenizer).state_dict()
    assert all(torch.equal(weights[k], base[k]) for k in base)


def test_the_exported_folder_loads_with_plain_transformers(tokenizer, tmp_path):
    model = lora_model(tokenizer)
    folder = save_inference_folder(model, tokenizer, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(forward_logits(loaded, IDS, MASK), forward_logits(model, IDS, MASK), atol=1e-5, rtol=0)
    assert AutoTokenizer.from_pretrained(folder)("sean")["input_ids"] == tokenizer("sean")["input_ids"]


def test_adapters_that_are_not_w_plus_delta_are_refused(tokenizer):
    dora = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in unmergeable_reason(dora)
    with pytest.raises(ValueError, match="DoRA"):
        inference_weights(dora)
    assert unmergeable_reason(apply_lora(tiny_model(tokenizer), r=4)) is None


def test_a_module_trained_in_full_is_sent_as_the_copy_the_model_computes_with(tokenizer):
    """peft's modules_to_save (a reward model's or critic's head) keeps the original module and a
    trained copy: the copy is sent under the module's plain names, the original with adapters off."""
    model = get_peft_model(
        tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    torch.manual_seed(0)
    with torch.no_grad():
        model.get_base_model().lm_head.modules_to_save["default"].weight.add_(torch.randn(1) * 0.1)
    plain = tiny_model(tokenizer)
    weights = inference_weights(model)
    assert weights.keys() == plain.state_dict().keys()
    plain.load_state_dict(weights)
    torch.testing.assert_close(forward_logits(plain, IDS, MASK), forward_logits(model, IDS, MASK), atol=1e-5, rtol=0)
    with model.disable_adapter():
        assert torch.equal(inference_weights(model)["lm_head.weight"], tiny_model(tokenizer).lm_head.weight)


def test_whole_tensors_gathered_from_shards_fold_as_the_module_does(tokenizer):
    """``whole``: the state dict FSDP2 gathers for a final folder; folded alike, from its tensors."""
    model = lora_model(tokenizer)
    whole = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    own, gathered = inference_weights(model), inference_weights(model, whole)
    assert own.keys() == gathered.keys()
    for name, tensor in own.items():
        torch.testing.assert_close(gathered[name], tensor, atol=1e-6, rtol=0)
    # the tensors come from whole, not from the module
    embeddings = whole["base_model.model.model.embed_tokens.weight"]
    assert gathered["model.embed_tokens.weight"].data_ptr() == embeddings.data_ptr()
