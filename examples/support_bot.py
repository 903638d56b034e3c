"""Seed 001's third MDP, the service bot: multi-turn RL against a simulated user.

The policy is a support bot; the ``support_bot`` environment is a rule-based user with a hidden
issue among six (``posttrain/envs/support_bot.py``). Its first message states the bot's language
(``ask: <clue>?``, ``fix: <fix>``) and a symptom that two issues share; it answers questions
truthfully and says "thanks, it works now!" when the bot gives the right fix (reward 1, episode
over); every bot turn costs 0.1, a wrong fix 0.5 more.

1. **Cold start**: a tiny Llama and a character tokenizer are built here and fine-tuned on
   scripted dialogues of a *searching* bot — it asks about the clues in a random order,
   whatever the symptom, until the user says "yes.", then gives that clue's fix; four turns at
   most, so when the clue comes late the user gives up. Each dialogue is replayed through the
   environment into the token ids and masks RL itself builds (``envs/episode.py:
   replay_actions``), so every bot turn is trained on exactly the context RL continues. The
   bot learns the language and that a "yes." names the fix, not which clues fit the symptom.
2. **RL**: ``posttrain rl --config configs/support_bot_grpo.yaml``: GRPO over whole episodes,
   each turn's reward on its last token, the environment's tokens in the context but never
   trained.

Printed and written to ``summary.json``: held-out resolution rate, turns per resolved
conversation, turns per conversation and mean return, [before, after] RL, greedy and over
four sampled episodes per row (``eval_k``: the sampled bot is the one RL trains; the greedy
one resolves only when its first question hits, so its turns per resolution start at the
minimum of 2), and the greedy bot's dialogues on three issues before and after.

    python examples/support_bot.py               # runs/support_bot/{sft,grpo}
    python examples/support_bot.py --variant dapo         # DAPO for the RL stage
    python examples/support_bot.py --variant curriculum   # patient users first (data.curriculum)
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
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.sources.environment import EnvironmentSource
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.offline import LoopConfig, train_offline
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_sources import sampling_plan
from posttrain.train.sft import SFTObjective

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "support_bot_grpo.yaml"
SFT_STEPS, SCRIPTED_EPISODES = 300, 600
BEFORE_AFTER = (("before", "sft"), ("after", "grpo"))
FIGURES = {  # summary name: evaluation metric (eval/<metric>, eval/sampled_<metric>)
    "resolved": "resolved",
    "turns_per_resolution": "turns_per_resolution",
    "turns": "turns_mean",
    "return": "reward",
}
# the same runs, evaluated on fewer rows and only before and after: in 30 steps the sampled
# resolution already rises but the turns per resolution fall only later (docs/examples.md, the support bot's table)
QUICK_RL = ["eval_every=0", "eval_size=48"]
# the RL stage's algorithm and data order besides the config's GRPO over every row (--variant)
VARIANTS = {
    "grpo": [],
    # DAPO: clip-higher, dynamic sampling (groups of episodes whose returns are all equal are
    # dropped and more rows drawn) and overlong shaping of an episode's sampled tokens
    "dapo": ["algorithm=dapo"],
    # patient users first: a row's difficulty d takes d turns off its user's patience (4, 3, 2);
    # the next level once half of a step's episodes resolve without a wrong fix (return >= 0.5)
    "curriculum": [
        "data.curriculum.column=difficulty", "data.curriculum.levels=[0, 1, 2]", "data.curriculum.window=3",
        "data.curriculum.advance_at=0.5", "data.curriculum.pass_score=0.5",
    ],
}  # fmt: skip


def cold_start(out: Path, seed: int, steps: int) -> dict[str, Any]:
    """SFT of a fresh tiny model on scripted episodes of the searching bot
    (:func:`~posttrain.envs.support_bot.scripted_actions`), saved in ``out/final``."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        len(tokenizer), arch="llama", layers=2, hidden=128, heads=4, seed=seed, tokenizer=tokenizer, max_positions=512
    )
    env_options = load_rl_config(CONFIG, []).env.options
    limits = EpisodeLimits(max_new_tokens=32, max_turns=env_options["max_turns"])
    scripts = scripted_actions(SCRIPTED_EPISODES, seed, max_turns=env_options["max_turns"])
    episodes = [replay_actions(tokenizer, SupportBot(**env_options), row, actions, limits) for row, actions in scripts]
    config = LoopConfig(
        steps=steps, batch_size=16, learning_rate=2e-3, warmup_steps=10, seed=seed, output_dir=str(out),
        overwrite=True, report_to=[], log_every=50,
    )  # fmt: skip
    objective = SFTObjective(model, tokenizer)
    examples = [(episode.ids, episode.mask) for episode in episodes]
    history = train_offline(objective, examples, config, label="sft", progress_keys=["loss/sft"])
    return {"sft_steps": len(history)}


def summarise(rl_dir: Path) -> dict[str, Any]:
    """Held-out figures, [before, after], of the first and the last evaluation of the RL run:
    greedy and over the sampled episodes."""
    evals = [r for r in read_jsonl(rl_dir / "metrics.jsonl") if "eval/resolved" in r]
    first, last = evals[0], evals[-1]
    summary = {}
    for mode, prefix in (("greedy", "eval/"), ("sampled", "eval/sampled_")):
        for name, key in FIGURES.items():
            if prefix + key in first:
                summary[f"{mode}_{name}"] = [first[prefix + key], last[prefix + key]]
    levels = [r["curriculum/level"] for r in read_jsonl(rl_dir / "metrics.jsonl") if "curriculum/level" in r]
    if levels:  # the step each level was first drawn at
        summary["curriculum_level_from_step"] = {int(level): levels.index(level) + 1 for level in sorted(set(levels))}
    return summary


def dialogues(model_dir: Path, rows: list[dict[str, Any]]) -> list[str]:
    """Greedy episodes of a saved bot on ``rows``, as readable text (the RL stage's settings)."""
    model, tokenizer = load_causal_lm(model_dir), load_tokenizer(model_dir)
    config = load_rl_config(CONFIG, ["prompts_per_step=1", "eval_k=0"])
    source = EnvironmentSource(
        sampling_plan(config), config.env, build_engine(model, tokenizer), tokenizer, rows, None, 512
    )
    source.evaluate(rows)
    shown = []
    for episode in source.last_result:
        opening = episode["prompt"][-1]["content"].split("\n")[-1]
        turns = [f"{'bot' if m['role'] == 'assistant' else 'user'}: {m['content']}" for m in episode["conversation"]]
        end = "resolved" if episode["resolved"] else "not resolved"
        shown.append(" | ".join([f"user: {opening}", *turns]) + f"  [{end}, return {episode['return']:+.1f}]")
    return shown


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/support_bot", help="holds sft/ and grpo/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the test's shortened run")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="grpo", help="the RL stage's algorithm")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    start = time.perf_counter()
    summary: dict[str, Any] = {"variant": args.variant, **cold_start(out / "sft", args.seed, SFT_STEPS)}
    summary["sft_s"] = round(time.perf_counter() - start, 1)
    rl = ["rl", "--config", str(CONFIG), f"model.path={out / 'sft' / 'final'}", f"output_dir={out / 'grpo'}"]
    rl += ["overwrite=true", f"seed={args.seed}", *VARIANTS[args.variant], *(QUICK_RL if args.quick else [])]
    if posttrain(rl) != 0:
        raise SystemExit("the RL stage failed")
    summary["rl_s"] = round(time.perf_counter() - start - summary["sft_s"], 1)
    summary.update(summarise(out / "grpo"))
    rows = support_rows(3, seed=12345)  # the same three issues, before and after
    summary["dialogues"] = {stage: dialogues(out / name / "final", rows) for stage, name in BEFORE_AFTER}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
