#!/usr/bin/env python
"""RLHF end to end on a CPU (seed 000, example 3; seeds 001 and 002), and reward hacking.

Six runs, each an ordinary ``posttrain`` command driven by a config in ``configs/``:

1. **SFT** on demonstrations (``rlhf_sft.yaml``): the preferred response of each pair of the
   synthetic preference task, whose "human raters" are a fixed rule
   (``posttrain/data/tasks/preference.py``), so the true preference of anything stays measurable.
2. **Reward model** (``rlhf_rm.yaml``): Bradley–Terry on the pairs, from the SFT model.
3. **PPO with the KL penalty** (``rlhf_ppo.yaml``): GAE, a critic, r_t − β·KL_t with an
   adaptive β. The rule is logged beside the reward model with weight 0: measured, not optimised.
4. **The same PPO with β = 0**: the reward model's score keeps rising while the true
   preference peaks and falls and the text degenerates — over-optimisation of a learned
   reward (Gao et al., "Scaling Laws for Reward Model Overoptimization", 2022).
5. **DPO** (``rlhf_dpo.yaml``) on the same pairs, from the same SFT model.
6. **DPO with RPO's NLL term** (the same config, ``nll_coef=0.2``): the chosen answers' own
   likelihood kept up, so the policy stays near the language of the data.

Then every policy samples the same held-out prompts and is scored on one table: reward-model
score, true preference (the rule), win rate against the SFT model's samples under the rule,
KL to the SFT model, share of responses that repeat a word, and training wall time.

    .venv/bin/python examples/rlhf.py                    # about 7 minutes on 2 cores
    .venv/bin/python examples/rlhf.py --quick            # the test suite's short version

Writes ``runs/rlhf/``: ``sft/ rm/ ppo/ ppo_beta0/ dpo/ rpo/`` (each a normal run directory),
``rlhf_hacking.png``, ``report.html`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from posttrain.config import load_config
from posttrain.data.tasks import get_task
from posttrain.data.tasks.preference import response_words, true_preference_score
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.logprobs import response_logprobs
from posttrain.rewards.model_reward import ModelReward
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams
from posttrain.telemetry.metrics import read_jsonl
from posttrain.telemetry.report import write_report
from posttrain.train.recipes import DPORun, RewardModelRun, SFTRun, run_dpo, run_reward_model, run_sft
from posttrain.train.rl import run_rl
from posttrain.train.rl_config import load_rl_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# β = 0: no KL in the reward; the KL is still measured (rlhf_ppo.yaml sets algorithm.kl.monitor)
BETA_ZERO = ["algorithm.kl.placement=none", "algorithm.kl.coef=0", "algorithm.kl.controller=fixed"]
CURVES = {
    "reward/reward_model/mean": "reward-model score (optimised)",
    "reward/preference_rule/mean": "true preference (the rule; not optimised)",
    "kl/ref": "KL to the SFT model (per token)",
}


@dataclass(frozen=True)
class Budget:
    """Steps of each stage; ``--quick`` shortens them for the test suite."""

    sft_steps: int = 400
    rm_steps: int = 500
    ppo_steps: int = 150
    dpo_steps: int = 300
    ppo_learning_rate: float = 1e-4
    dpo_learning_rate: float = 1e-4
    rpo_nll_coef: float = 0.2  # Llama 3's weight; 1.0 (the paper's) kept it nearer SFT and won less
    compare_prompts: int = 100
    compare_samples: int = 4


QUICK = Budget(
    sft_steps=200,
    rm_steps=200,
    ppo_steps=60,
    dpo_steps=100,
    ppo_learning_rate=3e-4,
    dpo_learning_rate=5e-4,
    compare_prompts=40,
)


OFFLINE = {"sft": (SFTRun, run_sft), "rm": (RewardModelRun, run_reward_model), "dpo": (DPORun, run_dpo)}


def run_stage(kind: str, config_file: str, overrides: list[str]) -> None:
    """``posttrain <kind> --config configs/<config_file> <overrides>``, in this process."""
    if kind == "rl":
        run_rl(load_rl_config(CONFIGS / config_file, overrides))
    else:
        config_cls, runner = OFFLINE[kind]
        runner(load_config(config_cls, CONFIGS / config_file, overrides))


def run_stages(out: Path, budget: Budget, seed: int, echo: Callable[[str], None] = print) -> dict[str, float]:
    """Train the six models into ``out/<stage>``; returns each stage's wall seconds."""
    sft, rm = out / "sft" / "final", out / "rm" / "final"
    ppo = [
        f"model.path={sft}",
        f"rewards=[{{name: reward_model, path: {rm}}}, preference_rule]",
        f"steps={budget.ppo_steps}",
        f"learning_rate={budget.ppo_learning_rate}",
    ]
    dpo = [f"model.path={sft}", f"steps={budget.dpo_steps}", f"learning_rate={budget.dpo_learning_rate}"]
    stages = [  # (run directory, command, config, overrides)
        ("sft", "sft", "rlhf_sft.yaml", [f"steps={budget.sft_steps}"]),
        ("rm", "rm", "rlhf_rm.yaml", [f"model.path={sft}", f"steps={budget.rm_steps}"]),
        ("ppo", "rl", "rlhf_ppo.yaml", ppo),
        ("ppo_beta0", "rl", "rlhf_ppo.yaml", [*ppo, *BETA_ZERO]),
        ("dpo", "dpo", "rlhf_dpo.yaml", dpo),
        ("rpo", "dpo", "rlhf_dpo.yaml", [*dpo, f"nll_coef={budget.rpo_nll_coef}"]),
    ]
    seconds = {}
    for name, kind, config_file, overrides in stages:
        echo(f"[rlhf] stage {name}: posttrain {kind} --config configs/{config_file}")
        start = time.perf_counter()
        run_stage(kind, config_file, [*overrides, f"seed={seed}", f"output_dir={out / name}", "overwrite=true"])
        seconds[name] = round(time.perf_counter() - start, 1)
    return seconds


@torch.no_grad()
def compare_policies(out: Path, names: list[str], prompts: list[str], samples: int, seed: int) -> dict[str, dict]:
    """Sample every policy on the same prompts and score the samples in the same ways.

    KL to SFT is the Monte-Carlo estimate E_{y~π}[log π(y|x) − log π_SFT(y|x)] in nats per
    response (the sequence-level KL the penalty bounds); the win rate pairs the j-th sample of
    a policy with the j-th sample of the SFT model for the same prompt (ties count one half).
    """
    tokenizer = load_tokenizer(out / "sft" / "final")
    reference = load_causal_lm(out / "sft" / "final").eval()
    reward_model = ModelReward(out / "rm" / "final")
    sampling = SamplingParams(n=samples, max_new_tokens=48, stop_strings=(".",), seed=seed)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expanded = [p for p in prompts for _ in range(samples)]
    results, true_scores = {}, {}
    for name in ["sft", *names]:
        policy = reference if name == "sft" else load_causal_lm(out / name / "final").eval()
        rollouts = build_engine(policy, tokenizer).generate(prompt_ids, sampling)
        mask = rollouts.response_mask
        ids = [row[: int(n)] for row, n in zip(rollouts.response_ids.tolist(), rollouts.response_lengths, strict=True)]
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        input_ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
        attention = torch.cat([rollouts.prompt_mask, mask.long()], 1)
        ref_logprobs, _ = response_logprobs(reference, input_ids, attention, rollouts.prompt_ids.shape[1])
        kl = ((rollouts.logprobs - ref_logprobs) * mask).sum(-1)
        true_scores[name] = torch.tensor([true_preference_score(p, t) for p, t in zip(expanded, texts, strict=True)])
        wins = (true_scores[name] > true_scores["sft"]).float() + 0.5 * (
            true_scores[name] == true_scores["sft"]
        ).float()
        repeats = [len(set(words)) < len(words) for words in map(response_words, texts)]
        results[name] = {
            "reward_model_score": float(torch.tensor(reward_model(expanded, texts, ids).values).mean()),
            "true_preference": float(true_scores[name].mean()),
            "win_rate_vs_sft": float(wins.mean()),
            "kl_to_sft_nats": float(kl.mean()),
            "repeated_word_share": sum(repeats) / len(repeats),
            "mean_words": sum(len(response_words(t)) for t in texts) / len(texts),
            "examples": texts[:: max(1, len(texts) // 6)][:6],
        }
    return results


def plot_hacking(out: Path, path: Path) -> Path:
    """Reward-model score, true preference and KL over PPO steps, with and without β."""
    runs = {"PPO, adaptive β (KL in the reward)": "ppo", "PPO, β = 0": "ppo_beta0"}
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.4 * len(CURVES), 3.4))
    for ax, (key, title) in zip(axes, CURVES.items(), strict=True):
        for label, folder in runs.items():
            points = [(r["step"], r[key]) for r in read_jsonl(out / folder / "metrics.jsonl") if key in r]
            ax.plot([s for s, _ in points], smooth([v for _, v in points]), label=label, linewidth=1.5)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("PPO step", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "Reward hacking: the learned reward rises either way; the true preference only with the KL penalty", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def smooth(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over ``window`` steps: single PPO batches are noisy."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def phase_means(metrics_path: Path, key: str, first: int = 5, last: int = 10) -> tuple[float, float]:
    """Mean of ``key`` over the first ``first`` and the last ``last`` logged steps."""
    values = [r[key] for r in read_jsonl(metrics_path) if key in r]
    return sum(values[:first]) / first, sum(values[-last:]) / last


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/rlhf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short stages (the test suite's version)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out, budget = Path(args.output_dir), QUICK if args.quick else Budget()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    seconds = run_stages(out, budget, args.seed)
    held_out = get_task("preference")(1, budget.compare_prompts, args.seed).held_out
    table = compare_policies(
        out, ["ppo", "ppo_beta0", "dpo", "rpo"], [r["prompt"] for r in held_out], budget.compare_samples, args.seed
    )
    for name, row in table.items():
        row["train_seconds"] = seconds.get(name)
    trends = {}
    for folder in ("ppo", "ppo_beta0"):
        for key in CURVES:
            first, last = phase_means(out / folder / "metrics.jsonl", key)
            trends[f"{folder}/{key}"] = {"first_steps": first, "last_steps": last}
    summary = {
        "policies": table,
        "ppo_trends": trends,
        "stage_seconds": seconds,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_hacking(out, out / "rlhf_hacking.png")
    columns = ["reward_model_score", "true_preference", "win_rate_vs_sft", "kl_to_sft_nats", "repeated_word_share"]
    lines = [f"{'policy':<10}" + "".join(f"{c:>22}" for c in columns) + f"{'train s':>10}"]
    for name, row in table.items():
        lines.append(f"{name:<10}" + "".join(f"{row[c]:>22.3f}" for c in columns) + f"{row['train_seconds'] or 0:>10}")
    samples = {name: "\n".join(row["examples"]) for name, row in table.items()}
    write_report(
        out,
        title="posttrain RLHF: SFT, reward model, PPO with and without KL, DPO with and without NLL",
        figures=["rlhf_hacking.png"],
        preformatted={"Held-out comparison": "\n".join(lines), **{f"Samples: {k}": v for k, v in samples.items()}},
        links={name: f"{name}/report.html" for name in seconds},  # every stage, in order
    )
    print("\n".join(["", *lines, "", f"[rlhf] report: {out / 'report.html'} ({summary['total_seconds']:.0f} s)"]))
    return summary


if __name__ == "__main__":
    main()
