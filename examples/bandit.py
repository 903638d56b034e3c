#!/usr/bin/env python
"""A 10-armed Gaussian bandit solved by REINFORCE with posttrain's algorithm core.

The smallest case of the policy gradient: one pull is a one-token episode. The policy is a
softmax over per-arm preferences θ, π(a) = softmax(θ/τ)_a, and each pull updates θ with the
same functions the language-model loop uses — ``ADVANTAGE_ESTIMATORS["reinforce"]`` for
A = r − b and ``POLICY_LOSSES["pg"]`` for L = −A·log π(a), plus an optional entropy bonus
−β·H(π). This is the gradient-bandit algorithm of Sutton & Barto (2018, §2.8).

The testbed follows their Figure 2.5: arm means q*(a) ~ N(4, 1), rewards r ~ N(q*(a), 1).
The offset of 4 is the point: every reward is positive, so without a baseline every pulled
arm is pushed up and the best arm is found late; with b = running mean of past rewards
(``RunningMeanBaseline``) only better-than-usual pulls are reinforced.

Every variant plays the same 50 seeded testbeds with the same random draws:

* ``no_baseline``: A = r;
* ``baseline``: A = r − b;
* ``baseline_entropy``: A = r − b and an entropy bonus β·H(π), β = 0.1 — more exploration:
  a little more regret on average, but fewer runs lock onto a second-best arm (less spread);
* ``baseline_sharp``: A = r − b with τ = 0.5 — a sharper softmax exploits sooner: some runs
  do very well, more lock onto a second-best arm (much more spread).

    .venv/bin/python examples/bandit.py       # a few seconds

Writes ``runs/bandit/``: ``regret.png`` (cumulative regret over the runs: mean, 10–90th percentile) and
``summary.json`` (final cumulative regret, share of pulls on the best arm, gradient variance).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posttrain.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, RunningMeanBaseline, entropy_from_logits


@dataclass(frozen=True)
class Variant:
    name: str
    use_baseline: bool
    entropy_coef: float = 0.0  # β of the bonus β·H(π)
    temperature: float = 1.0  # τ in π = softmax(θ/τ)


VARIANTS = (
    Variant("no_baseline", use_baseline=False),
    Variant("baseline", use_baseline=True),
    Variant("baseline_entropy", use_baseline=True, entropy_coef=0.1),
    Variant("baseline_sharp", use_baseline=True, temperature=0.5),
)


@dataclass(frozen=True)
class BanditConfig:
    arms: int = 10
    steps: int = 1000
    seeds: int = 50  # independent runs, each with its own testbed
    seed: int = 0  # the first testbed's seed; run i uses seed + i
    mean_offset: float = 4.0  # q*(a) ~ N(mean_offset, 1); Sutton & Barto Fig. 2.5 use 4
    lr: float = 0.1  # α, plain SGD on θ
    baseline_decay: float = 0.99  # RunningMeanBaseline's decay


def make_testbeds(config: BanditConfig) -> Tensor:
    """Arm means q* ``[S, K]``, one seeded testbed per run."""
    rows = [
        torch.randn(config.arms, generator=torch.Generator().manual_seed(config.seed + i)) + config.mean_offset
        for i in range(config.seeds)
    ]
    return torch.stack(rows)


def policy_gradient_step(preferences: Tensor, arms: Tensor, advantages: Tensor, variant: Variant, lr: float) -> None:
    """One SGD step on θ ``[S, K]`` for pulled ``arms [S]`` with advantages ``[S, 1]``.

    Each row is one run's one-token episode; ``token-sum`` keeps the rows' gradients apart,
    so the S runs are independent even though they share one backward pass.
    """
    logits = preferences / variant.temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, arms.unsqueeze(-1))  # [S, 1]
    loss, _ = POLICY_LOSSES["pg"](
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        advantages=advantages,
        response_mask=torch.ones_like(logprobs),
        agg_mode="token-sum",
    )
    if variant.entropy_coef:
        loss = loss - variant.entropy_coef * entropy_from_logits(logits).sum()
    preferences.grad = None
    loss.backward()
    with torch.no_grad():
        preferences -= lr * preferences.grad


def run_variant(variant: Variant, means: Tensor, config: BanditConfig) -> dict[str, Tensor]:
    """Play ``config.steps`` pulls in every testbed; returns per-step regret and best-arm hits ``[S, steps]``."""
    runs, arms = means.shape
    generator = torch.Generator().manual_seed(config.seed + 10_000)  # same draws for every variant
    preferences = torch.zeros(runs, arms, requires_grad=True)
    baselines = [RunningMeanBaseline(decay=config.baseline_decay) for _ in range(runs)]
    best_arm = means.argmax(-1)
    regret = torch.zeros(runs, config.steps)
    on_best = torch.zeros(runs, config.steps)
    for step in range(config.steps):
        with torch.no_grad():
            probs = torch.softmax(preferences / variant.temperature, dim=-1)
        pulled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        rewards = means.gather(-1, pulled.unsqueeze(-1)).squeeze(-1) + torch.randn(runs, generator=generator)
        options: dict[str, Any] = {}
        if variant.use_baseline:
            options["baseline_scores"] = torch.tensor([b.value for b in baselines])
        advantages, _ = ADVANTAGE_ESTIMATORS["reinforce"](
            token_rewards=rewards.unsqueeze(-1), response_mask=torch.ones(runs, 1), **options
        )
        policy_gradient_step(preferences, pulled, advantages, variant, config.lr)
        for baseline, reward in zip(baselines, rewards, strict=True):
            baseline.update(reward.unsqueeze(0))  # after use: a pull is never its own baseline
        regret[:, step] = means.max(-1).values - means.gather(-1, pulled.unsqueeze(-1)).squeeze(-1)
        on_best[:, step] = (pulled == best_arm).float()
    final_probs = torch.softmax(preferences.detach() / variant.temperature, dim=-1)
    return {"regret": regret, "on_best": on_best, "final_best_prob": final_probs.gather(-1, best_arm[:, None])[:, 0]}


def gradient_variance_at_start(means: Tensor, use_baseline: bool, samples: int = 20_000, seed: int = 0) -> float:
    """Total variance of the one-pull gradient estimate at the uniform policy, averaged over testbeds.

    Var[g] = E‖g − E g‖² with g = −∇_θ L for one pull. With the baseline, b is the uniform
    policy's expected reward — what a running mean converges to — so this isolates the effect
    the baseline has on the estimator (its mean is the same either way).
    """
    generator = torch.Generator().manual_seed(seed)
    variances = []
    for q in means:
        preferences = torch.zeros(samples, q.numel(), requires_grad=True)  # one row per sampled pull
        pulled = torch.randint(q.numel(), (samples,), generator=generator)
        rewards = q[pulled] + torch.randn(samples, generator=generator)
        advantages = (rewards - q.mean() if use_baseline else rewards).unsqueeze(-1)
        policy_gradient_step(preferences, pulled, advantages, Variant("probe", use_baseline), lr=0.0)
        grads = preferences.grad
        variances.append(float(((grads - grads.mean(0)) ** 2).sum(-1).mean()))
    return float(np.mean(variances))


def run(config: BanditConfig) -> dict[str, Any]:
    """Every variant on the same testbeds; returns the summary and the curves to plot."""
    means = make_testbeds(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of 10 × 10: extra threads only add synchronisation
    try:
        return _run_on(means, config)
    finally:
        torch.set_num_threads(threads)


def _run_on(means: Tensor, config: BanditConfig) -> dict[str, Any]:
    start = time.perf_counter()
    curves, variants = {}, {}
    last = max(1, config.steps // 10)
    for variant in VARIANTS:
        out = run_variant(variant, means, config)
        cumulative = out["regret"].cumsum(-1)
        curves[variant.name] = cumulative
        final = cumulative[:, -1]
        variants[variant.name] = {
            **asdict(variant),
            "final_cumulative_regret_mean": round(float(final.mean()), 2),
            "final_cumulative_regret_std": round(float(final.std()), 2),
            "best_arm_pull_fraction": round(float(out["on_best"].mean()), 3),
            "best_arm_pull_fraction_last_10pct": round(float(out["on_best"][:, -last:].mean()), 3),
            "final_best_arm_probability": round(float(out["final_best_prob"].mean()), 3),
        }
    summary = {
        "config": asdict(config),
        "variants": variants,
        "gradient_variance_at_uniform_policy": {
            "no_baseline": round(gradient_variance_at_start(means, use_baseline=False), 3),
            "baseline": round(gradient_variance_at_start(means, use_baseline=True), 3),
        },
        "wall_seconds": round(time.perf_counter() - start, 2),
    }
    return {"summary": summary, "curves": curves}


def write_report(result: dict[str, Any], output_dir: Path) -> None:
    """Save ``regret.png`` (cumulative regret: mean, 10th–90th percentile over runs) and ``summary.json``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    output_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, cumulative in result["curves"].items():
        mean = cumulative.mean(0).numpy()
        low, high = torch.quantile(cumulative, torch.tensor([0.1, 0.9]), dim=0).numpy()
        steps = np.arange(1, mean.size + 1)
        (line,) = ax.plot(steps, mean, label=name)
        # a percentile band, not ± std: regret is skewed (a few runs stuck on a worse arm) and never negative
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    config = result["summary"]["config"]
    ax.set(
        xlabel="pull",
        ylabel="cumulative regret",
        title=f"REINFORCE on a {config['arms']}-armed bandit, q* ~ N({config['mean_offset']:g}, 1), "
        f"{config['seeds']} runs",
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(output_dir / "regret.png", dpi=120)
    plt.close(fig)
    (output_dir / "summary.json").write_text(json.dumps(result["summary"], indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    defaults = BanditConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--seeds", type=int, default=defaults.seeds, help="independent runs per variant")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="pulls per run")
    parser.add_argument("--arms", type=int, default=defaults.arms)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--mean-offset", type=float, default=defaults.mean_offset, help="q*(a) ~ N(offset, 1)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bandit"))
    args = parser.parse_args(argv)
    config = BanditConfig(
        arms=args.arms, steps=args.steps, seeds=args.seeds, seed=args.seed, mean_offset=args.mean_offset, lr=args.lr
    )
    result = run(config)
    write_report(result, args.output_dir)
    for name, stats in result["summary"]["variants"].items():
        regret = f"{stats['final_cumulative_regret_mean']:7.1f} ± {stats['final_cumulative_regret_std']:5.1f}"
        print(
            f"{name:17s} regret {regret}   best arm: {stats['best_arm_pull_fraction']:.0%} of pulls, "
            f"{stats['best_arm_pull_fraction_last_10pct']:.0%} of the last 10%"
        )
    print(f"report in {args.output_dir} ({result['summary']['wall_seconds']} s)")
    return result["summary"]


if __name__ == "__main__":
    main()
