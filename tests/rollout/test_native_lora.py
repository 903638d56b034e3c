"""The native decoder runs a LoRA policy as peft runs it: adapters on, off, merged, after a step."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model

from posttrain.models.lora import apply_lora, reference_policy
from posttrain.rollout.engine import build_engine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.projections import unsupported_reason
from posttrain.rollout.types import SamplingParams
from tests.rollout.conftest import encode, full_forward_logprobs, tiny_model

PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13], [0, 14, 15, 16, 17, 18]])


def randomize_adapters(model, seed: int = 0, std: float = 0.2) -> None:
    """B starts at zero (the adapters then change nothing and prove nothing): make it random."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std)


def lora_model(tokenizer, arch: str = "llama", kv_heads: int | None = None):
    model = apply_lora(tiny_model(tokenizer, arch, kv_heads=kv_heads), r=4, alpha=8, dropout=0.1)
    randomize_adapters(model)
    return model.eval()


def forward_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def decoder_logits(decoder: NativeDecoder, steps: int = 3, repeats: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill ``PROMPTS`` and decode fixed continuations; return the logits of each step and
    the model's own next-token logits at the same positions, ``[B, steps + 1, V]``."""
    mask = (PROMPTS != 0).long()
    generator = torch.Generator().manual_seed(0)
    continuations = torch.randint(4, decoder.embed.shape[0], (len(PROMPTS) * repeats, steps), generator=generator)
    logits = [decoder.prefill(PROMPTS, mask, max_new_tokens=steps, repeats=repeats)]
    logits += [decoder.decode(continuations[:, t]).clone() for t in range(steps)]  # decode reuses its buffer
    ids = torch.cat([PROMPTS.repeat_interleave(repeats, 0), continuations], 1)
    full_mask = torch.cat([mask.repeat_interleave(repeats, 0), torch.ones_like(continuations)], 1)
    reference = forward_logits(decoder.model, ids, full_mask)[:, PROMPTS.shape[1] - 1 :]
    return logits, reference


def assert_decoder_matches_model(decoder: NativeDecoder) -> torch.Tensor:
    logits, reference = decoder_logits(decoder)
    for t, got in enumerate(logits):
        torch.testing.assert_close(got, reference[:, t], atol=1e-5, rtol=0)
    return reference


def test_auto_picks_the_native_decoder_for_a_lora_policy(tokenizer):
    model = lora_model(tokenizer)
    assert unsupported_reason(model) is None
    assert isinstance(build_engine(model, tokenizer, "auto").decoder, NativeDecoder)


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha-untied", "gqa-tied"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_the_peft_forward(tokenizer, arch, kv_heads):
    model = lora_model(tokenizer, arch, kv_heads)
    with_adapters = assert_decoder_matches_model(NativeDecoder(model))
    with model.disable_adapter():
        _, base = decoder_logits(NativeDecoder(model))
    # the adapters move the logits far beyond the tolerance, so fusing them is what is tested
    assert (with_adapters - base).abs().max() > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampled_logprobs_equal_a_full_forward_on_the_peft_model(tokenizer, arch):
    model = lora_model(tokenizer, arch, kv_heads=2)
    engine = build_engine(model, tokenizer, "native")
    sampling = SamplingParams(n=4, max_new_tokens=12, seed=1, temperature=0.7, top_p=0.9)
    out = engine.generate(encode(tokenizer), sampling)
    assert out.response_lengths.max() > 3
    assert (out.logprobs - full_forward_logprobs(model, out, sampling)).abs().max() < 1e-5


def test_an_optimizer_step_on_the_adapters_is_followed(tokenizer):
    model = lora_model(tokenizer)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)  # the step moves the adapters only
    engine = build_engine(model, tokenizer, "auto")
    sampling = SamplingParams(n=2, max_new_tokens=8, seed=0)
    before = engine.generate(encode(tokenizer), sampling)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    ids = torch.tensor(encode(tokenizer)[0])[None]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = engine.generate(encode(tokenizer), sampling)  # no update_weights: the step must be noticed
    assert not torch.equal(before.logprobs, after.logprobs)
    assert (after.logprobs - full_forward_logprobs(model.eval(), after)).abs().max() < 1e-5


def test_reference_policy_runs_the_base_weights(tokenizer):
    model = lora_model(tokenizer)
    decoder = NativeDecoder(model)
    policy = assert_decoder_matches_model(decoder)
    with reference_policy(model):
        reference = assert_decoder_matches_model(decoder)  # the same decoder notices the switch
    assert (policy - reference).abs().max() > 0.1
    assert_decoder_matches_model(decoder)  # and the switch back
    # the engine's log-probs inside the block are the reference policy's
    engine = build_engine(model, tokenizer, "native")
    with reference_policy(model):
        out = engine.generate(encode(tokenizer), SamplingParams(n=2, max_new_tokens=8, seed=0))
        assert (out.logprobs - full_forward_logprobs(model, out)).abs().max() < 1e-5


def test_merged_and_switched_adapters(tokenizer):
    model = lora_model(tokenizer, "qwen2", kv_heads=2)
    decoder = NativeDecoder(model)
    unmerged = assert_decoder_matches_model(decoder)
    model.merge_adapter()  # writes the deltas into the base weights through .data
    merged = assert_decoder_matches_model(decoder)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    with model.disable_adapter():
        # fuse before peft's own forward, which unmerges: the decoder must subtract the merged deltas
        logits, _ = decoder_logits(decoder)
        _, base = decoder_logits(NativeDecoder(tiny_model(tokenizer, "qwen2", kv_heads=2)))
        torch.testing.assert_close(logits[0], base[:, 0], atol=1e-5, rtol=0)
    assert not model.base_model.model.model.layers[0].self_attn.q_proj.merged  # peft's forward unmerged them
    # a second adapter, active alone and then together with the first
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    randomize_adapters(model, seed=1)
    model.set_adapter("other")
    other = assert_decoder_matches_model(decoder)
    assert (other - unmerged).abs().max() > 0.1
    model.base_model.set_adapter(["default", "other"])
    both = assert_decoder_matches_model(decoder)
    assert (both - other).abs().max() > 0.1


def test_what_cannot_be_fused_is_refused_with_a_reason(tokenizer):
    def reason(config):
        return unsupported_reason(get_peft_model(tiny_model(tokenizer), config))

    assert "DoRA" in reason(LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert "lora_bias" in reason(LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    assert "lm_head" in reason(LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert "embed_tokens" in reason(LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    assert "lm_head" in reason(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert "embed_tokens" in reason(LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[5, 6]))
    ia3 = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    assert "type IA3" in reason(ia3)

    dora = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert type(build_engine(dora, tokenizer, "auto").decoder).__name__ == "TransformersDecoder"
    with pytest.raises(ValueError, match="DoRA"):
        build_engine(dora, tokenizer, "native")
