"""Options of the RL loop that unit tests cover only as functions, run through `OnlineRL` with
their effect on the step checked: the step warnings, mask_truncated, GPG, GSPO-token, dual clip
and truncated importance sampling against a real engine/trainer mismatch."""

from __future__ import annotations

import math
import re
from collections import defaultdict

import pytest
import torch

from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from tests.train.test_rl import SMALL, TINY, constant, vowel_share


def train(tmp_path, name, overrides, rewards=(vowel_share,)):
    """(metrics history, echoed lines, final policy weights) of a run."""
    lines: list[str] = []
    config = load_rl_config(None, [*TINY, *SMALL, f"output_dir={tmp_path / name}", *overrides])
    run = OnlineRL(config, reward_functions=list(rewards), echo=lines.append)
    history = run.run()
    weights = {k: v.detach().clone() for k, v in run.policy.state_dict().items()}
    return history, lines, weights


def same_weights(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_step_warnings_name_the_cause_once_per_window(tmp_path):
    # a reward that gives every sample 0.5: every group is flat, every advantage 0
    history, lines, _ = train(tmp_path, "flat", ["steps=3", "preflight=false"], rewards=(constant,))
    warnings = [line for line in lines if line.startswith("[warning]")]
    flat = [w for w in warnings if "gave all their samples the same reward" in w]
    zero = [w for w in warnings if "every advantage is 0" in w]
    truncated = [w for w in warnings if "hit max_new_tokens=6" in w]
    # each cause is named at step 1 and not repeated in the next 49 steps
    assert [w.split(":")[0] for w in flat + zero] == ["[warning] step 1"] * 2
    assert "100% of groups" in flat[0] and "dynamic_sampling" in flat[0]
    assert all(m["advantage/abs_max"] == 0.0 for m in history)
    # the truncation warning quotes the step's own metric
    share = history[0]["response/truncated_fraction"]
    assert share > 0.5 and len(truncated) == 1
    assert re.search(rf"\b{100 * share:.0f}% of completions", truncated[0])

    # a reward that varies within groups raises neither of the first two
    _, lines, _ = train(tmp_path, "varied", ["steps=2"])
    assert not [line for line in lines if "same reward" in line or "every advantage is 0" in line]


def test_a_policy_that_solves_every_prompt_after_failing_is_not_warned_about(tmp_path):
    # step 1 scores vary; from step 2 every sample gets the best score: learned, not a flat reward
    calls = []

    def solved_after_the_first_batch(prompts, completions, completion_ids, **columns):
        calls.append(1)
        return vowel_share(prompts, completions, completion_ids) if len(calls) == 1 else [1.0] * len(completions)

    history, lines, _ = train(tmp_path, "solved", ["steps=3"], rewards=(solved_after_the_first_batch,))
    assert [m["reward/zero_variance_at_max_fraction"] for m in history[1:]] == [1.0, 1.0]
    assert not [line for line in lines if "same reward" in line or "every advantage is 0" in line]


def test_mask_truncated_leaves_cut_completions_out_of_the_gradient(tmp_path):
    # one new token: every completion that is not a lone EOS is cut by max_new_tokens
    common = ["steps=3", "max_new_tokens=1"]
    plain, _, _ = train(tmp_path, "plain", common)
    masked, _, _ = train(tmp_path, "masked", [*common, "algorithm.mask_truncated=true"])
    all_cut = [i for i, m in enumerate(masked) if m["response/truncated_fraction"] == 1.0]
    assert all_cut, [m["response/truncated_fraction"] for m in masked]
    for i in all_cut:  # nothing left to train on: no gradient, where the same step without the mask has one
        assert masked[i]["policy/grad_norm"] == 0.0 and masked[i]["loss/policy"] == 0.0
        assert plain[i]["policy/grad_norm"] > 0 and plain[i]["advantage/abs_max"] > 0


def test_gpg_advantages_in_the_loop_follow_its_formula(tmp_path):
    # log every sample: A_i = α (r_i − μ_g), α = B / #{i: r_i ≠ 0} (verl's nonzero_scores)
    overrides = ["steps=2", "algorithm.advantage=gpg", "algorithm.policy_loss=pg", "log_samples=16"]
    train(tmp_path, "gpg", overrides)
    samples = read_jsonl(tmp_path / "gpg" / "samples.jsonl")
    for step in (1, 2):
        batch = [s for s in samples if s["step"] == step]
        assert len(batch) == 16
        groups = defaultdict(list)
        for sample in batch:
            groups[sample["prompt"]].append(sample["reward"])
        alpha = len(batch) / max(sum(s["reward"] != 0 for s in batch), 1)
        assert alpha > 1  # some completions have no vowel: GPG's rescaling is visible
        for sample in batch:
            mean = sum(groups[sample["prompt"]]) / len(groups[sample["prompt"]])
            assert sample["advantage"] == pytest.approx(alpha * (sample["reward"] - mean), abs=1e-5)


def test_gspo_token_matches_gspo_on_sequence_level_advantages_and_differs_from_ppo(tmp_path):
    # two epochs: the second is off-policy, so the ratios (sequence vs token) matter
    common = ["steps=2", "ppo_epochs=2", "algorithm.agg_mode=seq-mean-token-mean"]
    losses = {}
    for loss in ("gspo", "gspo_token", "ppo_clip"):
        history, _, _ = train(tmp_path, loss, [*common, f"algorithm.policy_loss={loss}"])
        losses[loss] = [m["loss/policy"] for m in history]
    assert losses["gspo_token"] == pytest.approx(losses["gspo"], rel=1e-3)
    assert losses["ppo_clip"] != pytest.approx(losses["gspo"], rel=1e-2)


def test_dual_clip_bounds_the_loss_of_negative_advantages_in_the_loop(tmp_path):
    # a large step size and four epochs push some ratios past c = 3 on tokens with A < 0
    common = ["steps=2", "ppo_epochs=4", "learning_rate=0.05"]
    plain, _, plain_weights = train(tmp_path, "plain", common)
    never, _, never_weights = train(tmp_path, "never", [*common, "algorithm.loss_options={clip_c: 1.0e9}"])
    dual, _, dual_weights = train(tmp_path, "dual", [*common, "algorithm.loss_options={clip_c: 3.0}"])
    assert all(m.get("policy/dual_clip_fraction", 0.0) == 0.0 for m in plain + never)
    assert sum(m["policy/dual_clip_fraction"] for m in dual) > 0
    # a bound that never binds changes nothing; one that binds changes the update
    assert [m["loss/policy"] for m in never] == [m["loss/policy"] for m in plain]
    assert same_weights(never_weights, plain_weights) and not same_weights(dual_weights, plain_weights)


def test_truncated_importance_weights_correct_a_real_engine_trainer_mismatch(tmp_path):
    # bfloat16: the engine's cached decoding and the trainer's full forward round differently, a
    # real mismatch (as vLLM's kernels against the trainer's). With cap 1, ratios above 1 are cut.
    common = ["steps=1", "model.dtype=bfloat16"]
    plain, _, _ = train(tmp_path, "plain", common)
    tis, _, _ = train(tmp_path, "tis", [*common, "rollout.tis_cap=1"])
    metrics = tis[0]
    assert metrics["rollout/logprob_diff_max"] > 1e-3
    assert 0 < metrics["rollout/tis_capped_fraction"] < 1 and metrics["rollout/tis_weight_mean"] < 1
    # the same samples and advantages, weighted: the loss moves
    assert metrics["reward/mean"] == plain[0]["reward/mean"]
    assert not math.isclose(metrics["loss/policy"], plain[0]["loss/policy"], rel_tol=1e-6)


def test_dynamic_sampling_that_keeps_no_group_trains_the_step_on_nothing_and_goes_on(tmp_path):
    # every group flat in every round: DAPO's filter keeps none; the step is one that trains no
    # sample (every advantage 0), as without dynamic sampling, instead of an empty batch that the
    # run read as "no sample has a reward" and stopped on
    overrides = ["steps=2", "preflight=false", "algorithm=dapo", "algorithm.overlong.enabled=false"]
    history, lines, _ = train(tmp_path, "none_kept", overrides, rewards=(constant,))
    assert [m["step"] for m in history] == [1, 2]
    assert [m["dynamic_sampling/kept_groups"] for m in history] == [0.0, 0.0]
    assert all(m["advantage/abs_max"] == 0.0 and m["reward/mean"] == 0.5 for m in history)
    assert [line for line in lines if "dynamic sampling kept 0 of" in line]
    # the flat-groups warning's advice is to enable dynamic sampling: not given when it is on
    assert not [line for line in lines if "gave all their samples the same reward" in line]
