"""examples/rlhf.py, shortened: SFT → reward model → PPO with and without the KL penalty → DPO.

The directions of the seeds' point about reward hacking must hold even in the short version:
without β the learned reward rises while the true preference (the labelling rule) does not —
and the reward-hacking alarm says so —, with β the true preference rises and the KL stays small
(no alarm), and DPO raises the true preference.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhf.py"
# the reward-hacking alarm (checked by tests/examples/conftest.py): the β = 0 run raises it, the
# KL-regularised one does not
ALARMS_EXPECTED = ["ppo_beta0"]


def load_example():
    spec = importlib.util.spec_from_file_location("posttrain_example_rlhf", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_rlhf_example_shows_reward_hacking_and_its_mitigation(tmp_path):
    summary = load_example().main(["--quick", "--output-dir", str(tmp_path)])
    trends, policies = summary["ppo_trends"], summary["policies"]

    def rise(run, key):
        return trends[f"{run}/{key}"]["last_steps"] - trends[f"{run}/{key}"]["first_steps"]

    rm, true = "reward/reward_model/mean", "reward/preference_rule/mean"
    # The runs are chaotic: the same seed with another thread count or CPU samples other answers
    # after ~20 steps (tests/examples/conftest.py). Measured over five runs (one thread, 50 and 60
    # steps; two threads, 50 steps, three times on two machines): the reward model's score rose by
    # 1.96-3.15 in either run, the true preference by 0.18-1.01 with β and fell by 1.58-2.02
    # without it, the held-out win rate of PPO over SFT was 0.59-0.74 and its true preference
    # 0.36-0.99 above SFT's. So the thresholds assert the directions the seeds claim, with room
    # for a CPU not measured.
    # β = 0: the learned reward goes up, the true preference does not follow it
    assert rise("ppo_beta0", rm) > 1.0, trends
    assert rise("ppo_beta0", true) < 0.25, trends
    # β > 0: both go up, and the policy stays closer to the SFT model
    assert rise("ppo", rm) > 1.0 and rise("ppo", true) > 0.0, trends
    assert rise("ppo", true) - rise("ppo_beta0", true) > 0.5, trends
    assert trends["ppo/kl/ref"]["last_steps"] < trends["ppo_beta0/kl/ref"]["last_steps"], trends
    # on held-out prompts: PPO with β, DPO and RPO beat the SFT model under the rule
    assert policies["ppo"]["win_rate_vs_sft"] > 0.5, policies["ppo"]
    assert policies["ppo"]["true_preference"] > policies["sft"]["true_preference"] + 0.2, policies
    assert policies["dpo"]["true_preference"] > policies["sft"]["true_preference"], policies
    # RPO's NLL term keeps DPO near the data (quick run, one thread: KL 4.4 against 46.7 nats)
    assert policies["rpo"]["true_preference"] > policies["sft"]["true_preference"], policies
    assert policies["rpo"]["kl_to_sft_nats"] < policies["dpo"]["kl_to_sft_nats"], policies
    assert policies["ppo"]["kl_to_sft_nats"] < policies["ppo_beta0"]["kl_to_sft_nats"], policies
    assert json.loads((tmp_path / "summary.json").read_text())["policies"].keys() == policies.keys()
    assert (tmp_path / "rlhf_hacking.png").stat().st_size > 10_000
    assert (tmp_path / "report.html").is_file()
    # the alarm: raised by step 40 of 60 at one thread here (found at 20 against steps 1-10,
    # confirmed by 21-40); the β = 0 runs above raised it at steps 40-46 (rewards/hacking_alarm.py)
    alarm = json.loads((tmp_path / "ppo_beta0" / "alarm.json").read_text())
    assert alarm["monitor"]["name"] == "preference_rule" and alarm["optimised"]["after"] > alarm["optimised"]["before"]
