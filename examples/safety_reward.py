#!/usr/bin/env python
"""A model-based reward by direct assessment (seeds 000 and 001): a classifier's P(safe).

The seeds' first kind of learned reward is a classifier that reads a response and says how
safe (or helpful) it is; RL then maximises its probability. Here, on a CPU:

1. A careless writer answers "Describe the <animal>." like the preference task's writer, but a
   third of its answers contain a rude word (rude, nasty, ugly, dumb, smelly) — the "unsafe"
   class. A rule knows which answers are unsafe, so the effect of RL can be measured.
2. **Classifier**: a tiny Llama with a 2-label head (``unsafe``, ``safe``), trained here on
   labelled answers with cross-entropy, saved as a normal ``AutoModelForSequenceClassification``
   folder.
3. **SFT** of a tiny policy on the careless writer (``posttrain sft`` on a JSONL file).
4. **GRPO** with the reward ``{name: reward_model, path: <classifier>, label: safe,
   include_prompt: false}`` — the classifier's softmax probability of ``safe`` for the
   response alone — plus 0.25 × the preference task's rule (``preference_rule``: kind words,
   naming the animal) as a helpfulness term. The unsafe-word rule is logged with weight 0.

Why the helpfulness term: with P(safe) alone (``--helpfulness-weight 0``) the policy learns
within a few steps that the safest answer is no answer — it writes ``.`` and P(safe) reaches
0.98, even with a KL penalty of 0.2. Safety RLHF pairs a harmlessness reward with a
helpfulness one for that reason (Bai et al. 2022; Touvron et al. 2023, two reward models).

    .venv/bin/python examples/safety_reward.py           # about 3 minutes on 2 cores
    .venv/bin/python examples/safety_reward.py --quick   # the test suite's version

Writes ``runs/safety/``: ``data/``, ``classifier/``, ``sft/``, ``rl/`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from posttrain.config import load_config
from posttrain.data.tasks.preference import ANIMALS, PROMPT_TEMPLATE, response_words, sample_response
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.tiny import tiny_config
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rewards import resolve_reward
from posttrain.rewards.model_reward import ModelReward
from posttrain.rollout.engine import build_engine
from posttrain.rollout.types import SamplingParams
from posttrain.train.recipes import SFTRun, run_sft
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

RUDE_WORDS = ("rude", "nasty", "ugly", "dumb", "smelly")
RUDE_RATE = 0.35  # share of the careless writer's answers with a rude word
LABELS = {0: "unsafe", 1: "safe"}


def is_unsafe(text: str) -> bool:
    """The rule the classifier has to learn: the answer contains a rude word."""
    return any(word in RUDE_WORDS for word in response_words(text))


def careless_answer(rng: random.Random, animal: str) -> str:
    """The preference task's writer, with a rude word put in ``RUDE_RATE`` of the time."""
    answer = sample_response(rng, animal)
    if rng.random() >= RUDE_RATE:
        return answer
    words = answer.strip().rstrip(".").split()
    words.insert(rng.randrange(len(words) + 1), rng.choice(RUDE_WORDS))
    return " " + " ".join(words) + "."


def unsafe_words_rule(prompts: list[str], completions: list[str], completion_ids: Any = None, **columns: Any):
    """1.0 for an answer the rule calls unsafe: logged with weight 0, never optimised."""
    return [float(is_unsafe(c)) for c in completions]


def write_data(folder: Path, n_train: int, n_held_out: int, seed: int) -> dict[str, Path]:
    """JSONL files: SFT rows (prompt, completion), classifier rows (text, label), RL prompts."""
    rng = random.Random(f"safety-{seed}")
    folder.mkdir(parents=True, exist_ok=True)

    def rows(n: int) -> list[dict[str, str]]:
        prompts = [PROMPT_TEMPLATE.format(animal=rng.choice(ANIMALS)) for _ in range(n)]
        return [{"prompt": p, "completion": careless_answer(rng, p.split()[-1].rstrip("."))} for p in prompts]

    files = {"sft": rows(n_train), "classifier": rows(n_train), "classifier_held_out": rows(n_held_out)}
    for name in ("classifier", "classifier_held_out"):
        files[name] = [{"text": r["completion"], "label": int(not is_unsafe(r["completion"]))} for r in files[name]]
    files["prompts"] = [{"prompt": r["prompt"]} for r in rows(n_train)]
    paths = {}
    for name, content in files.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in content), encoding="utf-8")
    return paths


def train_classifier(paths: dict[str, Path], out: Path, steps: int, seed: int) -> float:
    """A 2-label tiny Llama trained on (answer + EOS, label) — the tokens ``reward_model``
    scores with ``include_prompt: false``; saved to ``out``. Returns held-out accuracy."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    config = tiny_config(len(tokenizer), layers=1, hidden=64, heads=2, tokenizer=tokenizer)
    config.num_labels, config.id2label = 2, dict(LABELS)
    config.label2id = {name: index for index, name in LABELS.items()}
    model = AutoModelForSequenceClassification.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def encode(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = [tokenizer(r["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in rows]
        batch = tokenizer.pad({"input_ids": ids}, padding_side="right", return_tensors="pt")
        return batch["input_ids"], batch["attention_mask"], torch.tensor([r["label"] for r in rows])

    train = [json.loads(line) for line in paths["classifier"].read_text().splitlines()]
    held_out = [json.loads(line) for line in paths["classifier_held_out"].read_text().splitlines()]
    order = random.Random(seed)
    model.train()
    for _ in range(steps):
        ids, mask, labels = encode(order.sample(train, 32))
        loss = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        ids, mask, labels = encode(held_out)
        accuracy = float((model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == labels).float().mean())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return accuracy


@torch.no_grad()
def assess(policy_dir: Path, classifier_dir: Path, prompts: list[str], samples: int, seed: int) -> dict[str, float]:
    """Sampled answers of a policy: the rule's unsafe share and the classifier's mean P(safe)."""
    tokenizer, model = load_tokenizer(policy_dir), load_causal_lm(policy_dir).eval()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    sampling = SamplingParams(n=samples, max_new_tokens=48, stop_strings=(".",), seed=seed)
    out = build_engine(model, tokenizer).generate(ids, sampling)
    texts = [
        tokenizer.decode(row[:length], skip_special_tokens=True)
        for row, length in zip(out.response_ids.tolist(), out.response_lengths.tolist(), strict=True)
    ]
    p_safe = ModelReward(classifier_dir, label="safe", include_prompt=False)([""] * len(texts), texts).values
    return {
        "unsafe_share": sum(map(is_unsafe, texts)) / len(texts),
        "p_safe": sum(p_safe) / len(p_safe),
        "mean_words": sum(len(response_words(t)) for t in texts) / len(texts),
        "examples": texts[:: max(1, len(texts) // 6)][:6],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/safety")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short stages (the test suite's version)")
    parser.add_argument("--helpfulness-weight", type=float, default=0.25, help="weight of preference_rule")
    args = parser.parse_args(argv)
    out, quick, started = Path(args.output_dir), args.quick, time.perf_counter()
    paths = write_data(out / "data", n_train=4000, n_held_out=500, seed=args.seed)
    accuracy = train_classifier(paths, out / "classifier", steps=150 if quick else 300, seed=args.seed)
    print(f"[safety] classifier held-out accuracy {accuracy:.3f}")
    run_sft(
        load_config(
            SFTRun,
            None,
            [
                "model.tiny.arch=llama",
                f"data.path={paths['sft']}",
                f"steps={150 if quick else 300}",
                f"seed={args.seed}",
                f"output_dir={out / 'sft'}",
                "overwrite=true",  # the example's own stage folders: running it again redoes them
            ],
        )
    )
    classifier = {"name": "reward_model", "path": str(out / "classifier"), "label": "safe", "include_prompt": False}
    config = load_rl_config(
        None,
        [
            f"model.path={out / 'sft' / 'final'}",
            f"data.path={paths['prompts']}",
            "algorithm=grpo",
            "algorithm.kl.coef=0.05",
            f"steps={15 if quick else 80}",
            f"prompts_per_step={8 if quick else 16}",
            "samples_per_prompt=8",
            "max_new_tokens=48",
            "sampling.stop=['.']",
            "learning_rate=3e-4",
            "reward_workers=0",
            "eval_size=0",
            f"seed={args.seed}",
            f"output_dir={out / 'rl'}",
            "overwrite=true",
        ],
    )
    rewards = [
        resolve_reward(classifier),
        resolve_reward("preference_rule", weight=args.helpfulness_weight),
        resolve_reward(unsafe_words_rule, weight=0.0),
    ]
    OnlineRL(config, reward_functions=rewards).run()
    prompts = [PROMPT_TEMPLATE.format(animal=animal) for animal in ANIMALS]
    samples = 20 if quick else 50
    before = assess(out / "sft" / "final", out / "classifier", prompts, samples, args.seed)
    after = assess(out / "rl" / "final", out / "classifier", prompts, samples, args.seed)
    summary = {
        "classifier_accuracy": accuracy,
        "before_rl": before,
        "after_rl": after,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"[safety] unsafe answers {100 * before['unsafe_share']:.1f}% -> {100 * after['unsafe_share']:.1f}%, "
        f"classifier P(safe) {before['p_safe']:.3f} -> {after['p_safe']:.3f}, words per answer "
        f"{before['mean_words']:.1f} -> {after['mean_words']:.1f} ({summary['seconds']:.0f} s)"
    )
    return summary


if __name__ == "__main__":
    main()
