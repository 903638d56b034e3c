"""Hand-computed expected values for every registry entry.

Each number below was worked out from the formula in docs/algorithms.md (by hand, or in plain
float64 Python arithmetic shown in the comment), never by calling the code under test.
`test_golden.py` fails if a registered name has no case here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


def t(values: Any) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


@dataclass
class Case:
    inputs: dict[str, Any]
    expected: Any  # [B, T] advantages, or the scalar loss
    options: dict[str, Any] = field(default_factory=dict)
    expected_returns: Any = None
    expected_metrics: dict[str, float] = field(default_factory=dict)


# ---- advantage estimators ----------------------------------------------------------------
# Four responses, two prompts: group 0 = rows 0, 1; group 1 = rows 2, 3. Outcome rewards
# r = [1, 0, 3, 1] sit on each row's last valid token.
MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
OUTCOME = {
    "token_rewards": t([[0, 1, 0], [0, 0, 0], [3, 0, 0], [0, 1, 0]]),
    "response_mask": t(MASK),
    "group_ids": torch.tensor([0, 0, 1, 1]),
}


def per_sequence(values: list[float]) -> torch.Tensor:
    """Broadcast one value per row onto MASK's valid tokens."""
    return t(values).unsqueeze(-1) * t(MASK)


SQRT_HALF = math.sqrt(0.5)  # unbiased std of {1, 0}
SQRT_TWO = math.sqrt(2.0)  # unbiased std of {3, 1}

ADVANTAGE_CASES: dict[str, list[Case]] = {
    "grpo": [
        # (r − μ_g)/(σ_g + 1e-4): ±0.5/(√0.5 + 1e-4), ±1/(√2 + 1e-4)
        Case(OUTCOME, per_sequence([0.7070067953266834, -0.7070067953266834, 0.7070567847218314, -0.7070567847218314])),
        # eps = 0 gives exactly ±1/√2·… = ±0.70710678
        Case(OUTCOME, per_sequence([1 / SQRT_TWO, -1 / SQRT_TWO, 1 / SQRT_TWO, -1 / SQRT_TWO]), {"eps": 0.0}),
        # batch std of [1, 0, 3, 1]: mean 1.25, Σ(x−μ)² = 0.0625+1.5625+3.0625+0.0625 = 4.75, /3
        Case(
            OUTCOME,
            per_sequence([v / math.sqrt(4.75 / 3) for v in (0.5, -0.5, 1.0, -1.0)]),
            {"eps": 0.0, "std_scope": "batch"},
        ),
    ],
    "dr_grpo": [Case(OUTCOME, per_sequence([0.5, -0.5, 1.0, -1.0]))],
    # k/(k−1)·(r − μ_g) with k = 2; equivalently r_i − r_other
    "rloo": [Case(OUTCOME, per_sequence([1.0, -1.0, 2.0, -2.0]))],
    # a = [.5, −.5, 1, −1] broadcast over 8 valid tokens, token mean −0.1875, unbiased var over 8 tokens
    "reinforce_pp_baseline": [
        Case(OUTCOME, per_sequence([0.9130506024415544, -0.41502300110979745, 1.5770874042172303, -1.0790598028854734]))
    ],
    "gpg": [
        # α = B/#{r ≠ 0} = 4/3
        Case(OUTCOME, per_sequence([4 / 3 * v for v in (0.5, -0.5, 1.0, -1.0)])),
        # every group varies, so M = 0 and α = 4/4
        Case(OUTCOME, per_sequence([0.5, -0.5, 1.0, -1.0]), {"alpha_mode": "valid_samples"}),
    ],
    "gdpo": [
        # components c1 = [1, 0, 1, 1], c2 = [0, 1, 2, 0]; per group (c − μ)/(σ + 1e-6):
        # c1 → [.7071, −.7071, 0, 0], c2 → [−.7071, .7071, .7071, −.7071]; S = [0, 0, .7071, −.7071];
        # whitened over the 8 valid tokens (row lengths 2, 3, 1, 2)
        Case(
            {**OUTCOME, "reward_components": t([[1, 0], [0, 1], [1, 2], [1, 0]])},
            per_sequence([0.19504736965238736, 0.19504736965238736, 1.7554263268714863, -1.3653315875667116]),
        ),
        # weights (1, 2), sequence-level (S − mean)/(std + 1e-4): S = [−.7071, .7071, 1.4142, −1.4142]
        Case(
            {**OUTCOME, "reward_components": t([[1, 0], [0, 1], [1, 2], [1, 0]])},
            per_sequence([-0.5476798245340841, 0.5476798245340841, 1.0953604236038565, -1.0953604236038565]),
            {"component_weights": [1.0, 2.0], "batch_norm": "sequence"},
        ),
    ],
    "gae": [
        # one row, an interior observation token at t = 2 (its reward 5 and value 9 are skipped);
        # γ = .9, λ = .8:  δ3 = 1 − .4 = .6;  δ1 = .9·.4 − .2 = .16, A1 = .16 + .72·.6 = .592;
        # δ0 = .9·.2 − .5 = −.32, A0 = −.32 + .72·.592 = .10624;  R = A + V
        Case(
            {
                "token_rewards": t([[0, 0, 5, 1]]),
                "response_mask": t([[1, 1, 0, 1]]),
                "values": t([[0.5, 0.2, 9.0, 0.4]]),
            },
            t([[0.10624, 0.592, 0.0, 0.6]]),
            {"gamma": 0.9, "lam": 0.8, "whiten": False},
            expected_returns=t([[0.60624, 0.792, 0.0, 1.0]]),
        ),
    ],
    "reinforce": [
        # γ = .5, masked t = 2 skipped: G3 = 3, G1 = 2 + .5·3 = 3.5, G0 = 1 + .5·3.5 = 2.75; baseline 1
        Case(
            {"token_rewards": t([[1, 2, 7, 3]]), "response_mask": t([[1, 1, 0, 1]]), "baseline_scores": t([1.0])},
            t([[1.75, 2.5, 0.0, 2.0]]),
            {"gamma": 0.5},
            expected_returns=t([[2.75, 3.5, 0.0, 3.0]]),
        ),
        # per-episode standardisation of G = [2.75, 3.5, 3]: mean 3.0833, unbiased std 0.38188
        Case(
            {"token_rewards": t([[1, 2, 7, 3]]), "response_mask": t([[1, 1, 0, 1]])},
            t(
                [
                    [
                        (2.75 - 37 / 12) / (math.sqrt(7 / 48) + 1.1920929e-07),
                        (3.5 - 37 / 12) / (math.sqrt(7 / 48) + 1.1920929e-07),
                        0.0,
                        (3 - 37 / 12) / (math.sqrt(7 / 48) + 1.1920929e-07),
                    ]
                ]
            ),
            {"gamma": 0.5, "standardize": "sequence"},
            expected_returns=t([[2.75, 3.5, 0.0, 3.0]]),
        ),
    ],
    "reinforce_pp": [
        # γ = .5; G = row0 [.5, 1, ·], row1 [0, 0, −1]; whitened over the 5 valid tokens
        Case(
            {"token_rewards": t([[0, 1, 0], [0, 0.5, -1]]), "response_mask": t([[1, 1, 0], [1, 1, 1]])},
            t(
                [
                    [0.539359885067322, 1.2135597414014745, 0.0],
                    [-0.1348399712668305, -0.1348399712668305, -1.4832396839351356],
                ]
            ),
            {"gamma": 0.5},
            expected_returns=t([[0.5, 1.0, 0.0], [0.0, 0.0, -1.0]]),
        ),
    ],
    "remax": [
        # G_t = Σ_{k≥t} r_k; A = G − b with greedy rewards b = [.5, 3]
        Case(
            {
                "token_rewards": t([[0, 1, 0], [0, 0, 2]]),
                "response_mask": t([[1, 1, 1], [1, 1, 1]]),
                "baseline_scores": t([0.5, 3.0]),
            },
            t([[0.5, 0.5, -0.5], [-1.0, -1.0, -1.0]]),
            expected_returns=t([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]),
        ),
    ],
}

# ---- policy losses -------------------------------------------------------------------------
# log ratios ℓ − ℓ_old = [[.2, 0], [−.5, ·]]; row 1's second token is padding (its ratio e^.3
# would change every result if it leaked in).
LOSS = {
    "logprobs": t([[-1.0, -0.5], [-2.0, -0.1]]),
    "old_logprobs": t([[-1.2, -0.5], [-1.5, -0.4]]),
    "advantages": t([[1.0, 1.0], [-2.0, -2.0]]),
    "response_mask": t([[1, 1], [1, 0]]),
}
E02, EM05 = math.exp(0.2), math.exp(-0.5)

POLICY_LOSS_CASES: dict[str, list[Case]] = {
    "ppo_clip": [
        # token losses: max(−1.2214, −1.2) = −1.2 (clipped); −1; max(2·.6065, 2·.8) = 1.6 (clipped)
        Case(LOSS, (-1.2 - 1.0 + 1.6) / 3, {}, expected_metrics={"clip_fraction": 2 / 3, "approx_kl": 0.1}),
        # clip-higher 0.28 leaves ρ = 1.2214 unclipped
        Case(LOSS, (-E02 - 1.0 + 1.6) / 3, {"clip_high": 0.28}, expected_metrics={"clip_fraction": 1 / 3}),
        # dual clip: A = −1, ρ = e² = 7.389 → PPO term 7.389, bounded by −c·A = 3
        Case(
            {"logprobs": t([[0.0]]), "old_logprobs": t([[-2.0]]), "advantages": t([[-1.0]]), "response_mask": t([[1]])},
            3.0,
            {"clip_c": 3.0},
            expected_metrics={"dual_clip_fraction": 1.0},
        ),
        # seq-mean-token-mean: ((−1.2 − 1)/2 + 1.6)/2
        Case(LOSS, ((-1.2 - 1.0) / 2 + 1.6) / 2, {"agg_mode": "seq-mean-token-mean"}),
    ],
    "gspo": [
        # log s = [.1, −.5]; s = [1.1052, .6065]; A_i = [1, −2]
        # row 0: max(−1.1052, −(1 + 4e-4)) = −1.0004; row 1: max(1.2131, 2·(1 − 3e-4)) = 1.9994
        Case(LOSS, (-1.0004 + 1.9994) / 2, expected_metrics={"clip_fraction": 1.0}),
    ],
    # same values as GSPO when advantages are constant within each sequence
    "gspo_token": [Case(LOSS, (-1.0004 + 1.9994) / 2)],
    "cispo": [
        # −sg(ρ)·A·ℓ: 1.2214·1·1, 1·1·.5, −.6065·2·2 (no bound is hit at cap 5)
        Case(LOSS, (E02 + 0.5 - 4 * EM05) / 3, expected_metrics={"clip_fraction": 0.0}),
        # cap 1.1 clips the first weight
        Case(LOSS, (1.1 + 0.5 - 4 * EM05) / 3, {"ratio_max": 1.1}, expected_metrics={"clip_fraction": 1 / 3}),
    ],
    "sapo": [
        # −(4/τ)·σ(τ(ρ − 1))·A; τ = 1 for A > 0, 1.05 for A < 0; seq-mean-token-mean
        Case(LOSS, 0.46166964423731227),
    ],
    "pg": [Case(LOSS, (1.0 + 0.5 - 4.0) / 3, expected_metrics={"clip_fraction": 0.0, "approx_kl": 0.1})],
    "decoupled_ppo": [
        # ℓ_prox = [[−1.1, −.5], [−1.5, ·]], ℓ_behav = [[−1.2, −.5], [−3.5, ·]]
        # w = e^{prox − behav} = [e^.1, 1, e^2 = 7.39 > cap 5 → masked]; u = e^{ℓ − prox} = [e^.1, 1, ·]
        # L = [w·max(−u, −clip(u)) = −e^.1·e^.1, −1, 0]; denominator keeps all 3 valid tokens
        Case(
            {
                **LOSS,
                "old_logprobs": t([[-1.2, -0.5], [-3.5, -0.4]]),
                "proximal_logprobs": t([[-1.1, -0.5], [-1.5, -0.4]]),
            },
            (-math.exp(0.2) - 1.0) / 3,
            expected_metrics={"behaviour_masked_fraction": 1 / 3},
        ),
        # sequence level: w_0 = e^{(.1 + 0)/2} = e^.05 for both tokens of row 0; w_1 = e^2 > 5 drops row 1
        Case(
            {
                **LOSS,
                "old_logprobs": t([[-1.2, -0.5], [-3.5, -0.4]]),
                "proximal_logprobs": t([[-1.1, -0.5], [-1.5, -0.4]]),
            },
            (-math.exp(0.05) * math.exp(0.1) - math.exp(0.05)) / 3,
            {"weight_level": "sequence"},
            expected_metrics={"behaviour_masked_fraction": 1 / 3},
        ),
        # clamp mode: the third weight is clipped to 5; u = e^{−.5}, A = −2 → max(2·.6065, 2·.8) = 1.6
        Case(
            {
                **LOSS,
                "old_logprobs": t([[-1.2, -0.5], [-3.5, -0.4]]),
                "proximal_logprobs": t([[-1.1, -0.5], [-1.5, -0.4]]),
            },
            (-math.exp(0.2) - 1.0 + 5 * 1.6) / 3,
            {"behaviour_weight": "clamp"},
        ),
    ],
}

# ---- preference losses ---------------------------------------------------------------------
# chosen log-ratios Δ_w = [1, 0], rejected Δ_l = [−1, 1]; h = [2, −1]; β = .5 → βh = [1, −.5]
PAIRS = {"chosen_logratios": t([1.0, 0.0]), "rejected_logratios": t([-1.0, 1.0]), "beta": 0.5}


def nls(x: float) -> float:
    """−log σ(x)."""
    return math.log1p(math.exp(-x))


PREFERENCE_LOSS_CASES: dict[str, list[Case]] = {
    "sigmoid": [
        Case(PAIRS, [nls(1.0), nls(-0.5)]),
        # cDPO with ε = .1: (1 − ε)·(−log σ(βh)) + ε·(−log σ(−βh))
        Case(PAIRS, [0.9 * nls(1.0) + 0.1 * nls(-1.0), 0.9 * nls(-0.5) + 0.1 * nls(0.5)], {"label_smoothing": 0.1}),
    ],
    "ipo": [
        # (h − 1/(2β))² = (2 − 1)², (−1 − 1)²
        Case(PAIRS, [1.0, 4.0]),
        # per-token averaged with n_w = [2, 1], n_l = [1, 2]: h' = [.5 + 1, 0 − .5]
        Case(PAIRS, [0.25, 2.25], {"chosen_lengths": t([2.0, 1.0]), "rejected_lengths": t([1.0, 2.0])}),
    ],
    "hinge": [Case(PAIRS, [0.0, 1.5])],
    "robust": [
        Case(
            PAIRS,
            [(0.9 * nls(1.0) - 0.1 * nls(-1.0)) / 0.8, (0.9 * nls(-0.5) - 0.1 * nls(0.5)) / 0.8],
            {"label_smoothing": 0.1},
        ),
    ],
}
