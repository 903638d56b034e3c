"""One calling convention, TRL's, wherever posttrain calls a reward function (a newcomer's first hour,
defect 1): `posttrain rl` (and its pre-flight check) and `posttrain eval` pass the prompts, the
completions, the completion ids and every other column by keyword, so a function written the
README's way (``def exact(prompts, completions, answer, **columns)``), TRL's way (``completions,
**kwargs``) or taking ``completion_ids`` scores the same everywhere. ``eval`` passed the first three
positionally: the README's own reward crashed it with ``got multiple values for argument 'answer'``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer

HERE = "tests.rewards.test_calling_convention"
ROWS = [{"prompt": f"What is {a} + {b}? Answer:", "answer": str(a + b)} for a in range(1, 5) for b in range(1, 5)]


def _score(completion: str, answer: str) -> float:
    """A 0/1 score a random model gets about half the time (answers are not what it writes)."""
    return float((len(completion) + int(answer)) % 2)


def readme_way(prompts, completions, answer, **columns):
    return [_score(c, a) for c, a in zip(completions, answer, strict=True)]


def trl_way(completions, **kwargs):
    return [_score(c, a) for c, a in zip(completions, kwargs["answer"], strict=True)]


def with_ids(prompts, completions, completion_ids, answer, **columns):
    assert len(completion_ids) == len(completions) and all(isinstance(i, int) for ids in completion_ids for i in ids)
    return [_score(c, a) for c, a in zip(completions, answer, strict=True)]


STYLES = ["readme_way", "trl_way", "with_ids"]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> tuple[Path, Path]:
    """(the data file, a tiny model folder)."""
    folder = tmp_path_factory.mktemp("task")
    data = folder / "my_task.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    tokenizer = build_char_tokenizer()
    build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer).save_pretrained(
        folder / "model"
    )
    tokenizer.save_pretrained(folder / "model")
    return data, folder / "model"


def test_eval_and_rl_score_a_reward_of_every_style_the_same(task, tmp_path, capsys):
    data, model = task
    accuracies, rewards = {}, {}
    for style in STYLES:
        capsys.readouterr()
        args = ["eval", "--model", str(model), "--data", str(data), "--reward", f"{HERE}:{style}", "--json"]
        assert main([*args, "--max-new-tokens", "6"]) == 0, capsys.readouterr().err
        accuracies[style] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["greedy_accuracy"]
        run = tmp_path / style
        args = ["rl", f"model.path={model}", f"data.path={data}", f"rewards=[{HERE}:{style}]", "steps=1"]
        args += ["prompts_per_step=4", "samples_per_prompt=4", "max_new_tokens=6", "eval_size=0", "report_to=[]"]
        args += ["reward_workers=0", f"output_dir={run}"]  # the pre-flight check runs: preflight is on by default
        assert main(args) == 0, capsys.readouterr().err
        rewards[style] = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["reward/mean"]
    assert len(set(accuracies.values())) == 1 and 0 < accuracies["readme_way"] < 1, accuracies
    assert len(set(rewards.values())) == 1 and 0 < rewards["readme_way"] < 1, rewards
