"""Padding-free passes (models/packing.py): samples laid end to end in one row give the padded
pass's log-probs, entropies and gradients (llama and qwen2, environment tokens, gradient
checkpointing), the row is laid out as documented, and the model's other forwards are unchanged
after the switch."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.loading import enable_checkpointing
from posttrain.models.logprobs import response_logprobs
from posttrain.models.packing import _per_document, pack_samples, packed_logprobs
from posttrain.models.tiny import build_tiny_causal_lm


def batch(seed: int = 0):
    """Six samples: prompts left-padded to 7, responses right-padded to 5, one response empty;
    ``widths`` include two environment tokens (attended, not scored) in sample 2."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(6, 7, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[3, :4] = 0
    prompt_ids = torch.randint(3, 50, (6, 7), generator=g).masked_fill(prompt_mask == 0, 0)
    attended = torch.ones(6, 5, dtype=torch.long)
    attended[1, 3:] = 0
    attended[4, 1:] = 0
    attended[5, :] = 0
    response_mask = attended.float()
    response_mask[2, 1:3] = 0  # an environment turn: context, never a target
    response_ids = torch.randint(3, 50, (6, 5), generator=g).masked_fill(attended == 0, 0)
    return prompt_ids, prompt_mask, response_ids, response_mask, attended


def padded(model, prompt_ids, prompt_mask, response_ids, response_mask, attended):
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, attended], 1)
    return response_logprobs(model, ids, mask, response_mask=response_mask, with_entropy=True, temperature=0.7)


def test_the_row_holds_each_sample_s_real_tokens_with_its_own_positions():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = (prompt_ids != 0).long()
    response_ids = torch.tensor([[11, 12, 0], [13, 0, 0]])
    packed, rows, columns = pack_samples(prompt_ids, prompt_mask, response_ids, torch.tensor([2, 1]))
    assert packed.input_ids.tolist() == [[5, 6, 11, 12, 7, 8, 9, 13]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.offsets.tolist() == [0, 4, 8] and packed.bounds == ((0, 4), (4, 8))
    assert packed.predictors.tolist() == [1, 2, 6] and packed.targets.tolist() == [11, 12, 13]
    assert rows.tolist() == [0, 0, 1] and columns.tolist() == [0, 1, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_equals_padded_in_values_and_gradients(arch):
    model = build_tiny_causal_lm(50, arch=arch, layers=2, hidden=32, heads=4, seed=0)
    prompt_ids, prompt_mask, response_ids, response_mask, attended = batch()
    expected, expected_entropy = padded(model, prompt_ids, prompt_mask, response_ids, response_mask, attended)
    got, entropy = packed_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, attended.sum(1), with_entropy=True, temperature=0.7
    )
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-6, rtol=0)
    assert (got[response_mask == 0] == 0).all() and (got[response_mask == 1] != 0).all()
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    grads_padded = torch.autograd.grad((expected * weights).sum(), list(model.parameters()))
    grads_packed = torch.autograd.grad((got * weights).sum(), list(model.parameters()))
    for a, b in zip(grads_padded, grads_packed, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    again, _ = padded(model, prompt_ids, prompt_mask, response_ids, response_mask, attended)
    torch.testing.assert_close(again, expected, atol=0, rtol=0)  # other forwards: as before the switch


def test_a_checkpointed_model_recomputes_its_layers_per_document():
    """The document bounds reach the recomputed layers in the backward pass (else they would attend
    across samples and the gradients would differ)."""
    model = build_tiny_causal_lm(50, layers=2, hidden=32, heads=4, seed=0)
    prompt_ids, prompt_mask, response_ids, response_mask, attended = batch(seed=2)
    expected, _ = padded(model, prompt_ids, prompt_mask, response_ids, response_mask, attended)
    reference = torch.autograd.grad(expected.sum(), list(model.parameters()))
    enable_checkpointing(model)
    model.train()
    got, _ = packed_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, attended.sum(1), temperature=0.7
    )
    for a, b in zip(reference, torch.autograd.grad(got.sum(), list(model.parameters())), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_a_sliding_window_cuts_each_document_alone():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g) for _ in range(3))
    out = _per_document(q, k, v, ((0, 3), (3, 9)), None, window=2)
    for start, end in ((0, 3), (3, 9)):
        at = torch.arange(end - start)
        allowed = (at[:, None] >= at[None, :]) & (at[:, None] - at[None, :] < 2)
        scores = (q[:, :, start:end] @ k[:, :, start:end].transpose(-1, -2)) / 2.0
        expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, :, start:end]
        torch.testing.assert_close(out[:, start:end], expected.transpose(1, 2), atol=1e-6, rtol=0)


def test_a_switched_model_saves_a_plain_config(tmp_path):
    """The switch is this process's: the saved folder names no posttrain attention and loads
    with plain transformers as it was."""
    from transformers import AutoModelForCausalLM

    model = build_tiny_causal_lm(50, layers=1, hidden=32, heads=4, seed=0)
    prompt_ids, prompt_mask, response_ids, response_mask, attended = batch()
    packed_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, attended.sum(1))
    model.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "posttrain" not in text
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def sliding_model(family: str):
    """A tiny model whose window (4) is shorter than the batch's samples (up to 12 tokens)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    sizes = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    sizes |= {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4}
    if family == "mistral":  # the window in its mask only: the attention module has no attribute for it
        config = MistralConfig(**sizes)
    else:
        config = Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_model_packed_equals_padded(family):
    """Hardening 3, item 13: Mistral's packed pass attended past its window (0.045 from padded)."""
    model = sliding_model(family)
    prompt_ids, prompt_mask, response_ids, response_mask, attended = batch()
    expected, _ = padded(model, prompt_ids, prompt_mask, response_ids, response_mask, attended)
    widths = attended.sum(1)
    got, _ = packed_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, widths, temperature=0.7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_model_that_computes_its_own_attention_is_refused_for_packing():
    """Bloom takes no attention function: packed, its samples would attend to each other."""
    from transformers import AutoModelForCausalLM, BloomConfig

    from posttrain.errors import PosttrainError

    model = AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=50))
    prompt_ids, prompt_mask, response_ids, response_mask, attended = batch()
    with pytest.raises(PosttrainError, match="BloomForCausalLM computes its own attention"):
        packed_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, attended.sum(1))


@pytest.mark.parametrize("command", [["rl", "padding_free=true"], ["sft", "packing=true", "max_length=64"]])
def test_packing_a_model_that_computes_its_own_attention_is_refused_before_it_loads(tmp_path, capsys, command):
    from transformers import AutoModelForCausalLM, BloomConfig

    from posttrain.cli import main
    from posttrain.models.tokenizers import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=len(tokenizer))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bloom")
    tokenizer.save_pretrained(tmp_path / "bloom")
    args = [*command, f"model.path={tmp_path / 'bloom'}", "data.task=reverse", "data.n_train=32", "data.n_eval=9"]
    capsys.readouterr()
    assert main([*args, f"output_dir={tmp_path / 'run'}", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "BloomForCausalLM computes its own attention" in err and "Traceback" not in err
