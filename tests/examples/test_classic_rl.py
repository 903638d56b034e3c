"""examples/cartpole_reinforce.py and examples/bandit.py: classic REINFORCE on posttrain.algos.

The CartPole run is shortened (no solve), so it checks that the return clearly rises; the
bandit checks that the policy settles on the best arm and that the baseline lowers regret
and the variance of the gradient estimate. Checked to fail with the gradient's sign flipped.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"posttrain_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cartpole_without_gymnasium_prints_the_install_hint(monkeypatch, capsys):
    example = load_example("cartpole_reinforce")
    real_import = builtins.__import__

    def no_gymnasium(name, *args, **kwargs):
        if name == "gymnasium":
            raise ImportError("No module named 'gymnasium'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gymnasium)
    with pytest.raises(SystemExit):
        example.main(["--quick", "--output-dir", "unused"])
    assert "pip install 'posttrain[examples]'" in capsys.readouterr().err


@pytest.mark.slow
def test_cartpole_reinforce_return_rises(tmp_path):
    pytest.importorskip("gymnasium")
    summary = load_example("cartpole_reinforce").main(["--quick", "--output-dir", str(tmp_path), "--log-every", "0"])
    returns = summary["episode_returns"]
    first, last = sum(returns[:20]) / 20, sum(returns[-20:]) / 20
    assert len(returns) == 150
    assert last >= 2 * first and last > 150, (first, last)
    assert json.loads((tmp_path / "summary.json").read_text())["episodes"] == 150
    assert (tmp_path / "learning_curve.png").stat().st_size > 0


def test_bandit_baseline_lowers_regret_and_finds_the_best_arm(tmp_path):
    example = load_example("bandit")
    summary = example.main(["--steps", "500", "--seeds", "20", "--output-dir", str(tmp_path)])
    no_baseline, baseline = summary["variants"]["no_baseline"], summary["variants"]["baseline"]
    assert baseline["final_cumulative_regret_mean"] < 0.8 * no_baseline["final_cumulative_regret_mean"]
    assert baseline["best_arm_pull_fraction_last_10pct"] > 0.6
    assert baseline["final_best_arm_probability"] > max(0.7, no_baseline["final_best_arm_probability"] + 0.1)
    variance = summary["gradient_variance_at_uniform_policy"]
    assert variance["baseline"] < variance["no_baseline"] / 3
    assert (tmp_path / "regret.png").stat().st_size > 0
