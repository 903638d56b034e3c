import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer


@pytest.mark.parametrize("arch, cls", [("llama", LlamaForCausalLM), ("qwen2", Qwen2ForCausalLM)])
def test_save_and_load_with_plain_transformers_gives_same_logits(arch, cls, tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), arch=arch, layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is cls and loaded.dtype == torch.float32
    assert loaded.config.tie_word_embeddings is False
    assert (loaded.config.pad_token_id, loaded.config.eos_token_id) == (0, 2)
    assert loaded.generation_config.eos_token_id == 2
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_sizes_follow_arguments():
    model = build_tiny_causal_lm(50, layers=3, hidden=64, heads=4, max_positions=128)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (3, 64, 256)
    assert config.max_position_embeddings == 128 and config.vocab_size == 50
    assert not torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)


def test_seed_fixes_weights_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_causal_lm(20, layers=1, hidden=16, heads=2, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = build_tiny_causal_lm(20, layers=1, hidden=16, heads=2, seed=7)
    c = build_tiny_causal_lm(20, layers=1, hidden=16, heads=2, seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="arch"):
        build_tiny_causal_lm(20, arch="gpt2")
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_causal_lm(20, hidden=30, heads=4)
