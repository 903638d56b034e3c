import math

import pytest
import torch

from posttrain.models.logprobs import token_logprobs


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
