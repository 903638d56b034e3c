"""Masked statistics and the five loss aggregation modes (docs/algorithms.md §1)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import AGGREGATION_MODES, aggregate_loss, masked_mean, masked_var, masked_whiten
from tests.algos.golden_cases import t

# S_i = [1+2, 4, 0]; n_i = [2, 1, 0]; N_tok = 3; B' = 2 (the empty third row is not a sequence)
LOSS = t([[1, 2, 3], [4, 5, 6], [7, 7, 7]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "options", "expected"),
    [
        ("token-mean", {}, 7 / 3),
        ("token-sum", {}, 7.0),
        ("seq-mean-token-sum", {}, 7 / 2),
        ("seq-mean-token-mean", {}, (3 / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", {"norm_constant": 4}, 7 / (2 * 4)),
        ("seq-mean-token-sum-norm", {}, 7 / (2 * 3)),  # C falls back to the padded width T = 3
        ("token-mean", {"num_tokens": 10}, 7 / 10),  # global count under gradient accumulation
        ("seq-mean-token-mean", {"num_seqs": 4}, (3 / 2 + 4 / 1) / 4),
    ],
)
def test_aggregation_modes(mode, options, expected):
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, mode, **options), t(expected))


def test_every_aggregation_mode_has_a_case():
    covered = {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    assert set(AGGREGATION_MODES) == covered


def test_unknown_aggregation_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate_loss(LOSS, MASK, "seq-mean")


def test_masked_slots_holding_nan_do_not_leak():
    poisoned = LOSS.clone()
    poisoned[0, 2] = float("nan")
    poisoned[2, :] = float("inf")
    for mode in AGGREGATION_MODES:
        assert torch.isfinite(aggregate_loss(poisoned, MASK, mode)), mode


def test_masked_mean_var_whiten():
    x = t([[1.0, 2.0, 100.0], [3.0, 50.0, 60.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask), t(2.0))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), t([1.5, 3.0]))
    torch.testing.assert_close(masked_var(x, mask), t(1.0))  # {1, 2, 3}: Σ(x−2)² = 2, / (3 − 1)
    torch.testing.assert_close(masked_var(x, mask, unbiased=False), t(2 / 3))
    white = masked_whiten(x, mask)
    torch.testing.assert_close(white, t([[-1 / math.sqrt(1 + 1e-8), 0.0, 0.0], [1 / math.sqrt(1 + 1e-8), 0.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False)[0, 0], t(-1 / math.sqrt(1 + 1e-8) + 2.0))


def test_variance_of_a_single_valid_element_is_zero_not_nan():
    assert masked_var(t([[5.0, 1.0]]), t([[1, 0]])) == 0
    assert torch.equal(masked_whiten(t([[5.0, 1.0]]), t([[1, 0]])), t([[0.0, 0.0]]))
