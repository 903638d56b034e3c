"""Seed 001's third MDP, the service bot: multi-turn RL against a simulated user.

The policy is a support bot; the ``support_bot`` environment is a rule-based user with a hidden
issue among six (``posttrain/envs/support_bot.py``). Its first message states the bot's language
(``ask: <clue>?``, ``fix: <fix>``) and a symptom that two issues share; it answers questions
truthfully and says "thanks, it works now!" when the bot gives the right fix (reward 1, episode
over); every bot turn costs 0.1, a wrong fix 0.5 more.

1. **Cold start**: a tiny Llama and a character tokenizer are built here and fine-tuned on
   scripted dialogues — ask one of the two candidate clues, then the fix the answer points to;
   a third of them first ask a needless question. Each dialogue is replayed through the
   environment into the token ids and masks RL itself builds (``envs/episode.py:
   replay_actions``), so every bot turn is trained on exactly the context RL continues. SFT
   stops early, leaving a bot that often resolves the issue but not always, nor in the fewest
   turns.
2. **RL**: ``posttrain rl --config configs/support_bot_grpo.yaml``: GRPO over whole episodes,
   each turn's reward on its last token, the environment's tokens in the context but never
   trained.

Printed and written to ``summary.json``: held-out resolution rate, turns per resolved
conversation and mean return, greedy, before and after RL, and a dialogue of each.

    python examples/support_bot.py               # runs/support_bot/{sft,grpo}
    python examples/support_bot.py --quick       # the test's shortened version
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.cli import main as posttrain
from posttrain.envs.episode import EpisodeLimits, replay_actions
from posttrain.envs.support_bot import SupportBot, scripted_actions, support_rows
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.sources.environment import EnvironmentSource
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.offline import LoopConfig, train_offline
from posttrain.train.rl_config import load_rl_config
from posttrain.train.sft import SFTObjective

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "support_bot_grpo.yaml"
SFT_MAX_STEPS, CHECK_EVERY, VALIDATION_ROWS = 200, 10, 48
STOP_AT, QUICK_STOP_AT = 0.9, 0.2  # greedy validation resolution that ends the cold start
QUICK_RL = ["steps=8", "eval_every=0", "eval_size=48", "prompts_per_step=8", "samples_per_prompt=4"]


def cold_start(out: Path, seed: int, max_steps: int, stop_at: float) -> dict[str, Any]:
    """SFT of a fresh tiny model on scripted episodes, stopped at the first check (every
    ``CHECK_EVERY`` steps) where greedy episodes on validation rows resolve at least ``stop_at``
    of the issues — a bot that is often right, not always, as the lecture's cold starts are.
    The model is saved in ``out/final``."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        len(tokenizer), arch="llama", layers=2, hidden=128, heads=4, seed=seed, tokenizer=tokenizer, max_positions=512
    )
    limits = EpisodeLimits(max_new_tokens=32, max_turns=4)
    episodes = [replay_actions(tokenizer, SupportBot(), row, acts, limits) for row, acts in scripted_actions(600, seed)]
    examples = [(episode.ids, episode.mask) for episode in episodes]
    checker = _validation_episodes(model, tokenizer, seed)
    checks: list[tuple[int, float]] = []

    def on_step(step: int, metrics: dict[str, float]) -> bool:
        if step % CHECK_EVERY:
            return False
        resolved = checker.evaluate(checker.rows)["eval/resolved"]
        metrics["eval/validation_resolved"] = resolved
        checks.append((step, resolved))
        print(f"[sft] step {step}: greedy validation episodes resolved {100 * resolved:.0f}%", flush=True)
        return resolved >= stop_at

    config = LoopConfig(
        steps=max_steps, batch_size=16, learning_rate=2e-3, warmup_steps=10, seed=seed, output_dir=str(out),
        overwrite=True, report_to=[], log_every=20,
    )  # fmt: skip
    objective = SFTObjective(model, tokenizer)
    history = train_offline(objective, examples, config, label="sft", progress_keys=["loss/sft"], on_step=on_step)
    return {"sft_steps": len(history), "sft_validation_resolved": checks[-1][1] if checks else None}


def _validation_episodes(model: Any, tokenizer: Any, seed: int) -> EnvironmentSource:
    """Greedy support_bot episodes of the model being trained (the native engine reads its
    live weights), the same environment settings as the RL stage."""
    config = load_rl_config(CONFIG, ["eval_batch_size=64", f"seed={seed}"])
    engine = build_engine(model, tokenizer)
    rows = support_rows(VALIDATION_ROWS, seed + 7)
    return EnvironmentSource(config, config.env, engine, tokenizer, rows, None, 512, echo=lambda line: None)


def summarise(rl_dir: Path) -> dict[str, Any]:
    """Greedy held-out figures of the first and the last evaluation of the RL run."""
    evals = [r for r in read_jsonl(rl_dir / "metrics.jsonl") if "eval/resolved" in r]
    first, last = evals[0], evals[-1]
    keys = {"resolved": "eval/resolved", "turns_per_resolution": "eval/turns_per_resolution", "return": "eval/reward"}
    return {name: [first[key], last[key]] for name, key in keys.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/support_bot", help="holds sft/ and grpo/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the test's shortened run")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    start = time.perf_counter()
    summary: dict[str, Any] = cold_start(
        out / "sft", args.seed, SFT_MAX_STEPS, QUICK_STOP_AT if args.quick else STOP_AT
    )
    summary["sft_s"] = round(time.perf_counter() - start, 1)
    rl = ["rl", "--config", str(CONFIG), f"model.path={out / 'sft' / 'final'}", f"output_dir={out / 'grpo'}"]
    rl += ["overwrite=true", f"seed={args.seed}", *(QUICK_RL if args.quick else [])]
    if posttrain(rl) != 0:
        raise SystemExit("the RL stage failed")
    summary["rl_s"] = round(time.perf_counter() - start - summary["sft_s"], 1)
    summary.update(summarise(out / "grpo"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
