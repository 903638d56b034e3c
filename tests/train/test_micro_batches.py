"""Micro-batches bounded by tokens: the cuts respect both bounds and keep every sample once, in
order; a run cut into token-bounded passes trains as the whole-minibatch run does (within float
summation order); the default budget is derived from the memory plan when no bound is set,
written into config.yaml and checkpoints, reused by a resume whatever memory it then has, and
the same on two ranks."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from posttrain.cli import main
from posttrain.train.micro_batches import example_cost, micro_batch_bounds, offline_passes, split_evenly
from posttrain.train.preference import PairExample
from tests.train.test_rl import make_run

RL = [
    "rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
    "data.n_train=64", "data.n_eval=9", "eval_size=0", "prompts_per_step=8", "samples_per_prompt=4",
    "max_new_tokens=8", "learning_rate=1e-3", "reward_workers=0", "report_to=[]", "device=cpu",
    "rewards=[tests.train.test_rl:vowel_share]", "save_every=1", "steps=3",
]  # fmt: skip
CUT = 512  # tokens: the minibatch (32 samples of up to 35 + 8 tokens) takes several passes


def memory_for(budget: int) -> float:
    """A ``memory_gib`` from which the plan derives ``budget``: between its peaks at ``budget`` and
    at the next budget up, put back into the units the derivation compares (micro_batch_budget.py)."""
    from posttrain.plan.micro_batch_budget import CPU_RESERVE, HEADROOM, QUANTUM
    from posttrain.plan.plan import make_plan, plan_inputs
    from posttrain.train.rl_config import load_rl_config

    config = load_rl_config(None, [*RL[1:], "output_dir=unused"])
    inputs = plan_inputs("rl", config)
    peaks = [make_plan(inputs, config.model_copy(update={"micro_batch_tokens": b})) for b in (budget, budget + QUANTUM)]
    target = sum(plan.peak - plan.runtime for plan in peaks) / 2
    return (target + CPU_RESERVE) / HEADROOM / 2**30


def test_bounds_keep_every_sample_in_order_within_both_limits():
    prompts = [5, 9, 3, 12, 7, 7, 2, 30, 4]
    responses = [8, 2, 8, 1, 8, 8, 8, 2, 8]
    for max_samples in (None, 1, 2, 3):
        for max_tokens in (None, 20, 40, 64):
            bounds = micro_batch_bounds(prompts, responses, max_samples, max_tokens)
            assert [i for start, end in bounds for i in range(start, end)] == list(range(len(prompts)))
            for start, end in bounds:
                rows = end - start
                width = max(prompts[start:end]) + max(responses[start:end])
                assert rows == 1 or max_samples is None or rows <= max_samples
                assert rows == 1 or max_tokens is None or rows * width <= max_tokens
    assert micro_batch_bounds(prompts, responses) == [(0, 9)]
    for max_tokens in (20, 40, 64):  # padding-free passes: each pass's own tokens are what counts
        bounds = micro_batch_bounds(prompts, responses, None, max_tokens, packed=True)
        assert [i for start, end in bounds for i in range(start, end)] == list(range(len(prompts)))
        own = [sum(prompts[start:end]) + sum(responses[start:end]) for start, end in bounds]
        assert all(end - start == 1 or cost <= max_tokens for (start, end), cost in zip(bounds, own, strict=True))
        assert len(bounds) <= len(micro_batch_bounds(prompts, responses, None, max_tokens))
    assert (7, 8) in micro_batch_bounds(prompts, responses, None, 20)  # longer than the budget: alone


def test_offline_passes_and_even_splits():
    assert offline_passes(8, 10, accumulation=2, max_tokens=None) == 2
    assert offline_passes(8, 10, accumulation=1, max_tokens=40) == 2  # 4 rows of 10 per pass
    assert offline_passes(8, 10, accumulation=4, max_tokens=40) == 4  # accumulation still a floor
    assert offline_passes(8, 100, accumulation=1, max_tokens=40) == 8  # one row a pass at least
    assert [len(chunk) for chunk in split_evenly(list(range(7)), 3)] == [3, 2, 2]


def test_example_costs():
    assert example_cost(([1, 2, 3], [0, 1, 1])) == (1, 3)
    assert example_cost(PairExample(chosen=([1] * 4, [1] * 4), rejected=([1] * 6, [1] * 6), margin=None)) == (2, 6)
    assert example_cost((([1, 2], [0, 1]), ([3, 4, 5], [0, 0, 1]))) == (1, 5)  # a packed row


def test_token_bounded_passes_train_as_the_whole_minibatch(tmp_path):
    base = ["algorithm=ppo", "steps=2", "ppo_epochs=2", "minibatch_size=8"]
    whole = make_run(tmp_path, base, name="whole").run()
    chunked_run = make_run(tmp_path, [*base, "micro_batch_tokens=40"], name="chunked")
    passes: list[tuple[int, int]] = []
    for model in (chunked_run.policy, chunked_run.critic):
        model.register_forward_hook(
            lambda module, args, kwargs, out: passes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
        )
    chunked = chunked_run.run()
    assert len(passes) > 8 and all(rows == 1 or rows * width <= 40 for rows, width in passes)
    keys = (
        "reward/mean",
        "loss/value",
        "loss/policy",
        "policy/entropy",
        "policy/grad_norm",
        "critic/explained_variance",
    )
    for key in keys:
        assert [h[key] for h in chunked] == pytest.approx([h[key] for h in whole], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("arch, lora", [("llama", False), ("qwen2", False), ("llama", True)])
def test_padding_free_passes_train_as_padded_ones(tmp_path, arch, lora):
    """GRPO with KL in the loss (reference passes) and an entropy bonus: packed passes of at most
    60 real tokens give the padded whole-minibatch run's losses, KL and gradient norms (LoRA too)."""
    base = [f"model.tiny.arch={arch}", "algorithm=grpo", "steps=2", "algorithm.kl.placement=loss",
            "algorithm.kl.coef=0.05", "algorithm.entropy_coef=0.01"]  # fmt: skip
    base += ["model.lora={r: 4, alpha: 8}"] if lora else []
    padded = make_run(tmp_path, base, name="padded").run()
    run = make_run(tmp_path, [*base, "padding_free=true", "micro_batch_tokens=60"], name="packed")
    rows: list[int] = []
    run.policy.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: rows.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
    )
    packed = run.run()
    assert len(rows) > 4 and all(tokens <= 60 for tokens in rows)
    for key in ("loss/policy", "kl/ref", "policy/entropy", "policy/grad_norm", "loss/total"):
        assert [h[key] for h in packed] == pytest.approx([h[key] for h in padded], rel=1e-4, abs=1e-6), key


def test_sft_passes_bounded_by_tokens_train_as_one_pass(tmp_path):
    args = ["sft", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
            "data.n_train=64", "data.n_eval=9", "eval_size=0", "batch_size=8", "steps=2", "report_to=[]"]  # fmt: skip
    assert main([*args, f"output_dir={tmp_path / 'one'}", "micro_batch_tokens=100000"]) == 0
    assert main([*args, f"output_dir={tmp_path / 'cut'}", "micro_batch_tokens=64"]) == 0
    one, cut = (_metrics(tmp_path / name) for name in ("one", "cut"))
    assert [m["loss/sft"] for m in cut] == pytest.approx([m["loss/sft"] for m in one], rel=1e-5)


def _metrics(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "grad_norm" in record or "policy/grad_norm" in record]


def _recorded(path) -> int | None:
    return yaml.safe_load((path / "config.yaml").read_text())["micro_batch_tokens"]


def _planned_budget(tmp_path, capsys, memory: float) -> int:
    capsys.readouterr()  # what earlier runs printed
    assert main([*RL, f"memory_gib={memory!r}", f"output_dir={tmp_path / 'planned'}", "--plan"]) == 0
    return int(re.search(r"micro-batch\s+(\d+) tokens \(derived", capsys.readouterr().out).group(1))


def test_the_derived_budget_is_recorded_and_a_resume_reuses_it(tmp_path, capsys):
    straight, memory = tmp_path / "straight", memory_for(CUT)
    assert main([*RL, f"memory_gib={memory!r}", f"output_dir={straight}"]) == 0
    derived = _recorded(straight)
    assert derived == CUT
    assert _recorded(straight / "checkpoints" / "step-2") == derived
    # with more memory the plan would derive a larger budget; the resume keeps the recorded one
    assert _planned_budget(tmp_path, capsys, memory=64) > derived
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-3")
    shutil.rmtree(resumed / "final")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= 2))
    assert main([*RL, "memory_gib=64", f"output_dir={resumed}", "--resume", "auto"]) == 0
    assert _recorded(resumed) == derived
    assert "recorded in the checkpoint" in capsys.readouterr().out
    last, resumed_last = _metrics(straight)[-1], _metrics(resumed)[-1]
    assert resumed_last["step"] == last["step"] == 3
    for key in ("loss/policy", "policy/grad_norm", "reward/mean"):
        assert resumed_last[key] == pytest.approx(last[key], abs=1e-6), key


@pytest.mark.slow
def test_two_ranks_derive_the_same_budget(tmp_path, capsys):
    from tests.train.test_distributed import posttrain

    memory = memory_for(CUT)
    assert _planned_budget(tmp_path, capsys, memory) == CUT
    done = posttrain([*RL, f"memory_gib={memory!r}", "steps=1", f"output_dir={tmp_path / 'two'}"], ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _recorded(tmp_path / "two") == CUT  # and each rank checked the others' (same_everywhere)


def test_a_checkpoint_recording_a_bad_budget_is_one_message(tmp_path, capsys):
    import hashlib

    run = tmp_path / "run"
    assert main([*RL, "steps=1", f"output_dir={run}"]) == 0
    checkpoint = run / "checkpoints" / "step-1"
    saved = checkpoint / "config.yaml"
    text = re.sub(r"micro_batch_tokens: \d+", "micro_batch_tokens: lots", saved.read_text())
    saved.write_text(text)
    marker = checkpoint / "COMPLETE"  # a crafted checkpoint comes with a manifest that matches it
    manifest = json.loads(marker.read_text())
    manifest["files"]["config.yaml"] = {
        "size": saved.stat().st_size,
        "sha256": hashlib.sha256(saved.read_bytes()).hexdigest(),
    }
    marker.write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main([*RL, "steps=2", f"output_dir={run}", "--resume", "auto"]) == 2
    error = capsys.readouterr().err
    assert "micro_batch_tokens is 'lots'" in error and "Traceback" not in error
