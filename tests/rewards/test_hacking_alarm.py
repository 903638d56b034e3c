"""The reward-hacking alarm: it fires on a planted hack — a reward that pays for a degenerate
answer (all x's) which the weight-0 monitor scores 0 — with the evidence in the log, alarm.json,
the report and the rollout page; it stays silent when the monitor agrees with the reward, and on
noise. (The RLHF example's β = 0 and KL runs: tests/examples/test_rlhf.py; every other example
stays silent: tests/examples/conftest.py.)"""

from __future__ import annotations

import json
import random

from posttrain.cli import main
from posttrain.rewards.hacking_alarm import HackingAlarm

RUN = [
    "rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
    "data.n_train=64", "data.n_eval=9", "eval_size=0", "steps=30", "prompts_per_step=4", "samples_per_prompt=8",
    "max_new_tokens=8", "learning_rate=3e-2", "monitor_window=10", "report_to=[]", "reward_workers=0",
]  # fmt: skip
HERE = "tests.rewards.test_hacking_alarm"


def x_share(prompts, completions, **columns):
    """The planted hack: pays for x's, so the policy learns to answer 'xxxxxxxx'."""
    return [sum(c == "x" for c in text) / max(len(text), 1) for text in completions]


def vowel_share(prompts, completions, **columns):
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def has_a_vowel(prompts, completions, **columns):
    return [float(any(c in "aeiou" for c in text)) for text in completions]


def test_a_planted_hack_raises_the_alarm_once_with_its_evidence(tmp_path, capsys):
    out = tmp_path / "hack"
    rewards = [f"rewards=[{HERE}:x_share, {HERE}:vowel_share]", "reward_weights=[1.0, 0.0]"]
    assert main([*RUN, *rewards, "allow_constant_reward=[vowel_share]", f"output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("possible reward hacking") == 1  # once, though the hack lasts to the end
    record = json.loads((out / "alarm.json").read_text())
    assert record["monitor"]["name"] == "vowel_share" and record["first_seen"] < record["step"] <= 30
    assert record["optimised"]["after"] > record["optimised"]["before"] + 0.3
    assert record["monitor"]["after"] < record["monitor"]["before"]
    samples = record["samples"]
    assert len(samples) == 3 and all(s["monitor"] == 0.0 and "xxx" in s["completion"] for s in samples)
    warnings = [json.loads(line) for line in (out / "warnings.jsonl").read_text().splitlines()]
    assert any("possible reward hacking" in str(w) for w in warnings)
    assert "Reward-hacking alarm" in (out / "report.html").read_text()
    assert '"monitor":{"name":"vowel_share"' in (out / "rollouts.html").read_text()  # the page's banner reads it


def test_a_monitor_that_agrees_with_the_reward_stays_silent(tmp_path, capsys):
    out = tmp_path / "agree"
    rewards = [f"rewards=[{HERE}:vowel_share, {HERE}:has_a_vowel]", "reward_weights=[1.0, 0.0]"]
    assert main([*RUN, *rewards, f"output_dir={out}"]) == 0
    assert "possible reward hacking" not in capsys.readouterr().out
    assert not (out / "alarm.json").exists()


def test_noise_with_a_rising_reward_does_not_raise_it():
    """A reward that rises while the monitor only wanders (Gaussian noise): 300 steps, 100 seeds."""
    fired = 0
    for seed in range(100):
        rng = random.Random(seed)
        alarm = HackingAlarm({"monitor": 1}, window=20, echo=lambda line: None, out=None)
        for step in range(1, 301):
            metrics = {"reward/mean": step / 300 + rng.gauss(0, 0.05), "reward/monitor/mean": rng.gauss(0.5, 0.05)}
            fired += alarm.observe(step, metrics) is not None
    assert fired <= 2  # ~0.2% of such runs warn (hacking_alarm.py's docstring); 7% without the confirmation


def test_a_dip_the_run_recovers_from_is_not_confirmed():
    """The monitor falls for 6 steps while the reward rises, then comes back (as a KL penalty pulls a
    policy back): found, not confirmed."""
    alarm = HackingAlarm({"monitor": 1}, window=10, echo=lambda line: None, out=None)
    rng = random.Random(0)
    for step in range(1, 61):
        monitor = (0.2 if 20 <= step < 26 else 0.8) + rng.gauss(0, 0.03)
        assert (
            alarm.observe(step, {"reward/mean": step / 60 + rng.gauss(0, 0.01), "reward/monitor/mean": monitor}) is None
        )
        if step == 25:
            assert "monitor" in alarm.candidates  # the dip was seen


# Per-step means of the RLHF example's quick PPO runs (examples/rlhf.py --quick, 32 prompts × 2
# samples a step): the reward model's score (optimised) and the labelling rule's (the monitor)
# β = 0, seed 0, two threads: the rule falls from ~1.5 to ~-0.5 by step 25 while the score
# climbs, the score collapses at steps 16-17 (the KL to the SFT model jumped to 3), the rule
# half recovers at 31-40 and falls again to -1.6. Each half-window after the collapse sits at
# the score's plateau, so no two neighbouring halves show the rise.
BETA0_SCORE = [
    2.29, 3.1, 2.96, 3.74, 4.59, 4.8, 5.06, 5.25, 5.77, 5.87, 5.73, 5.81, 5.41, 5.45, 5.74, 4.26, 4.18, 4.86,
    5.58, 5.62, 5.94, 6.16, 6.21, 6.06, 6.23, 6.26, 6.29, 6.26, 6.3, 6.08, 6.15, 6.43, 6.29, 6.36, 6.33, 6.42,
    6.26, 6.44, 6.49, 6.54, 6.57, 6.55, 6.48, 6.52, 6.58, 6.6, 6.61, 6.63, 6.63, 6.52,
]  # fmt: skip
BETA0_RULE = [
    0.77, 1.5, 1.3, 1.5, 1.81, 1.69, 1.69, 1.66, 1.36, 1.33, 1.39, 0.73, 0.78, 0.22, -0.25, 0.17, -0.16, -0.2,
    0.0, -0.2, 0.12, -0.58, -0.8, -0.31, -0.69, -0.75, -0.75, -0.7, -0.59, -0.38, 0.45, 0.28, 0.36, 0.23, 0.3,
    0.56, 0.36, 0.27, 0.28, 0.11, 0.16, -0.14, -0.12, -0.12, -0.33, -0.58, -1.11, -1.47, -1.73, -1.56,
]  # fmt: skip
# With the KL penalty (adaptive β), seed 8: the rule dips from ~1.6 to ~1.1 over steps 11-30 while
# the score climbs, then comes back above where it started (1.8-2.0) as the penalty pulls back.
KL_SCORE = [
    2.78, 2.51, 2.8, 3.95, 4.28, 4.47, 4.51, 5.19, 5.26, 5.37, 5.28, 5.13, 5.51, 5.1, 5.47, 5.66, 5.6, 5.61, 5.63,
    5.64, 5.84, 5.99, 5.9, 6.19, 6.1, 6.42, 6.31, 6.38, 6.46, 6.36, 6.31, 6.35, 6.2, 6.09, 6.05, 6.18, 6.11, 6.04,
    6.19, 6.13, 6.32, 6.34, 6.47, 6.45, 6.47, 6.44, 6.4, 6.37, 6.2, 6.13,
]  # fmt: skip
KL_RULE = [
    1.05, 1.23, 1.28, 1.7, 1.66, 1.7, 1.69, 1.83, 1.44, 1.66, 1.47, 1.41, 1.34, 1.36, 1.34, 1.3, 1.14, 1.39, 1.39,
    1.42, 1.19, 1.09, 1.08, 1.14, 1.27, 1.19, 1.12, 0.98, 1.02, 1.14, 1.59, 1.39, 1.78, 1.36, 2.0, 2.05, 1.83,
    1.95, 1.8, 1.86, 1.94, 1.64, 1.72, 1.73, 1.75, 1.86, 1.61, 1.39, 1.72, 1.48,
]  # fmt: skip


def first_alarm(score, monitor, window=20):
    alarm = HackingAlarm({"rule": 1}, window=window, echo=lambda line: None, out=None)
    records = (
        alarm.observe(step, {"reward/mean": s, "reward/rule/mean": m})
        for step, (s, m) in enumerate(zip(score, monitor, strict=True), 1)
    )
    return next((record for record in records if record is not None), None)


def test_a_fall_the_reward_collapse_interrupts_is_caught_against_the_first_half_window():
    record = first_alarm(BETA0_SCORE, BETA0_RULE)
    assert record is not None and record["steps"]["before"] == [1, 10]  # measured from the run's start
    assert record["monitor"]["after"] < 0 < 1.3 < record["monitor"]["before"]
    assert record["step"] <= 50


def test_a_twenty_step_dip_the_kl_penalty_pulls_back_is_not_confirmed():
    assert first_alarm(KL_SCORE, KL_RULE) is None


def test_a_falling_monitor_without_a_rising_reward_is_not_hacking():
    alarm = HackingAlarm({"monitor": 1}, window=10, echo=lambda line: None, out=None)
    rng = random.Random(0)
    records = [
        alarm.observe(step, {"reward/mean": 0.5 + rng.gauss(0, 0.01), "reward/monitor/mean": 1 - step / 40})
        for step in range(1, 41)
    ]
    assert records == [None] * 40
