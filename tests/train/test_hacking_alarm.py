"""The reward-hacking alarm: it fires on a planted hack — a reward that pays for a degenerate
answer (all x's) which the weight-0 monitor scores 0 — with the evidence in the log, alarm.json,
the report and the rollout page; it stays silent when the monitor agrees with the reward, and on
noise. (The RLHF example's β = 0 and KL runs: tests/examples/test_rlhf.py; every other example
stays silent: tests/examples/conftest.py.)"""

from __future__ import annotations

import json
import random

from posttrain.cli import main
from posttrain.train.hacking_alarm import HackingAlarm

RUN = [
    "rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
    "data.n_train=64", "data.n_eval=9", "eval_size=0", "steps=30", "prompts_per_step=4", "samples_per_prompt=8",
    "max_new_tokens=8", "learning_rate=3e-2", "monitor_window=10", "report_to=[]", "reward_workers=0",
]  # fmt: skip
HERE = "tests.train.test_hacking_alarm"


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


def test_a_falling_monitor_without_a_rising_reward_is_not_hacking():
    alarm = HackingAlarm({"monitor": 1}, window=10, echo=lambda line: None, out=None)
    rng = random.Random(0)
    records = [
        alarm.observe(step, {"reward/mean": 0.5 + rng.gauss(0, 0.01), "reward/monitor/mean": 1 - step / 40})
        for step in range(1, 41)
    ]
    assert records == [None] * 40
