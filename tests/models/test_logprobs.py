import math

import pytest
import torch

from posttrain.models.logprobs import response_logprobs, token_entropies, token_logprobs


def test_matches_hand_computed_values():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # softmax rows: [1/2, 1/2], [3/4, 1/4]
    tokens = torch.tensor([[1, 1]])
    expected = torch.tensor([[math.log(0.5), math.log(0.25)]])
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)


def test_random_batch_agrees_with_full_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    out = token_logprobs(logits, tokens)
    full = torch.log_softmax(logits, -1)
    for b in range(3):
        for t in range(5):
            torch.testing.assert_close(out[b, t], full[b, t, tokens[b, t]])


def test_low_precision_logits_give_float32():
    logits = torch.randn(2, 3, 7).bfloat16()
    assert token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float32


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(torch.zeros(2, 4, 7), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_naive_on_a_real_vocabulary(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 9, 32_000, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 32_000, (2, 9), generator=g)
    naive = torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 5, 4096):  # chunks that split rows unevenly too
        torch.testing.assert_close(token_logprobs(logits, tokens, chunk_size=chunk), naive, atol=1e-6, rtol=0)


def test_temperature_and_entropy():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 50, generator=g)
    tokens = torch.randint(0, 50, (2, 3), generator=g)
    tempered = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature=0.7, chunk_size=4), tempered)
    probs = torch.softmax(logits, -1)
    naive_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(token_entropies(logits, chunk_size=4), naive_entropy, atol=1e-6, rtol=0)


def test_response_logprobs_match_the_rollout_engine():
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.models.tokenizers import build_char_tokenizer
    from posttrain.rollout.engine import build_engine
    from posttrain.rollout.types import SamplingParams

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer).eval()
    engine = build_engine(model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("ab", "Reverse the name: x")]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=0))
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask.long()], 1)
    with torch.no_grad():
        logprobs, entropies = response_logprobs(
            model, ids, mask, out.prompt_ids.shape[1], temperature=0.8, with_entropy=True
        )
    torch.testing.assert_close(logprobs * out.response_mask, out.logprobs, atol=1e-5, rtol=0)
    assert entropies.shape == out.logprobs.shape
