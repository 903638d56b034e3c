"""Every registry entry against hand-computed values (see golden_cases.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PREFERENCE_LOSSES
from tests.algos.golden_cases import ADVANTAGE_CASES, POLICY_LOSS_CASES, PREFERENCE_LOSS_CASES, Case, t

REGISTRIES = [
    ("advantage", ADVANTAGE_ESTIMATORS, ADVANTAGE_CASES),
    ("policy loss", POLICY_LOSSES, POLICY_LOSS_CASES),
    ("preference loss", PREFERENCE_LOSSES, PREFERENCE_LOSS_CASES),
]


@pytest.mark.parametrize(("kind", "registry", "cases"), REGISTRIES, ids=[r[0] for r in REGISTRIES])
def test_every_registered_name_has_a_golden_case(kind, registry, cases):
    missing = sorted(name for name in registry if not cases.get(name))
    assert not missing, f"{kind} entries without a hand-computed golden test: {missing}"


def _ids(cases: dict[str, list[Case]]) -> list[tuple[str, int, Case]]:
    return [(name, i, case) for name, group in cases.items() for i, case in enumerate(group)]


def _close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, t(expected), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(("name", "index", "case"), _ids(ADVANTAGE_CASES), ids=lambda v: str(v)[:20])
def test_advantage_golden(name, index, case):
    advantages, returns = ADVANTAGE_ESTIMATORS[name](**case.inputs, **case.options)
    _close(advantages, case.expected)
    _close(returns, case.expected if case.expected_returns is None else case.expected_returns)


@pytest.mark.parametrize(("name", "index", "case"), _ids(POLICY_LOSS_CASES), ids=lambda v: str(v)[:20])
def test_policy_loss_golden(name, index, case):
    loss, metrics = POLICY_LOSSES[name](**case.inputs, **case.options)
    _close(loss, case.expected)
    assert {"clip_fraction", "approx_kl"} <= metrics.keys()
    for key, value in case.expected_metrics.items():
        _close(metrics[key], value)


@pytest.mark.parametrize(("name", "index", "case"), _ids(PREFERENCE_LOSS_CASES), ids=lambda v: str(v)[:20])
def test_preference_loss_golden(name, index, case):
    per_pair = PREFERENCE_LOSSES[name](**case.inputs, **case.options)
    _close(per_pair, case.expected)
