"""The online RL loop: every preset runs, invalid combinations are refused before training,
the pre-flight check stops a useless reward, a resumed run repeats a straight one exactly,
and reward rises on an easy task."""

from __future__ import annotations

import itertools
import math
import textwrap

import pytest
import torch

from posttrain.cli import main
from posttrain.config import ConfigError
from posttrain.rewards import RewardFunctionError
from posttrain.telemetry.metrics import read_jsonl
from posttrain.train.offline import TrainingDiverged
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_checks import RewardPreflightError
from posttrain.train.rl_config import load_rl_config, preset_names

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
SMALL = ["data.task=reverse", "data.n_train=64", "data.n_eval=9", "eval_size=0", "prompts_per_step=4"]
SMALL += ["samples_per_prompt=4", "max_new_tokens=6", "learning_rate=1e-3", "log_every=100", "reward_workers=0"]

ALL_PRESETS = [
    "grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "gdpo",
    "rloo", "remax", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "ppo", "areal", "one_step_off_policy",
]  # fmt: skip


def vowel_share(prompts, completions, completion_ids, **columns):
    """Share of vowels in the completion: varies between samples of a random model, easy to raise."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def has_dot(prompts, completions, completion_ids, **columns):
    return [float("." in text) for text in completions]


def constant(prompts, completions, completion_ids, **columns):
    return [0.5] * len(completions)


def make_run(tmp_path, overrides=(), rewards=(vowel_share,), name="run"):
    config = load_rl_config(None, [*TINY, *SMALL, f"output_dir={tmp_path / name}", *overrides])
    return OnlineRL(config, reward_functions=list(rewards), echo=lambda line: None)


def test_every_preset_named_in_the_issue_ships():
    assert set(ALL_PRESETS) <= set(preset_names())


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_every_preset_runs_and_moves_the_weights(tmp_path, preset):
    overrides = [f"algorithm={preset}", "steps=2"]
    rewards = (vowel_share, has_dot) if preset == "gdpo" else (vowel_share,)
    if preset == "dapo":
        overrides.append("algorithm.overlong.cache_length=2")
    run = make_run(tmp_path, overrides, rewards)
    before = [p.detach().clone() for p in run.policy.parameters()]
    history = run.run()
    assert len(history) == 2
    assert all(math.isfinite(h["loss/total"]) for h in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.parameters(), strict=True))
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    if preset == "ppo":
        assert "loss/value" in history[-1] and "critic/explained_variance" in history[-1]
    if run.algo.kl.placement != "none":
        assert "kl/ref" in history[-1]


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (["algorithm=ppo", "algorithm.critic=null"], ["algorithm.advantage", "algorithm.critic"]),
        (["algorithm=grpo", "samples_per_prompt=1"], ["algorithm.advantage", "samples_per_prompt"]),
        (["algorithm=rloo", "samples_per_prompt=1"], ["samples_per_prompt"]),
        (["algorithm=grpo", "algorithm.kl.placement=none"], ["algorithm.kl.coef", "algorithm.kl.placement"]),
        (["algorithm=grpo", "algorithm.kl.estimator=k1"], ["algorithm.kl.estimator"]),
        (["algorithm=dapo", "algorithm.kl.placement=loss"], ["algorithm.kl.placement", "algorithm.kl.coef"]),
        (["algorithm=grpo", "algorithm.kl.controller=adaptive"], ["algorithm.kl.controller"]),
        (["algorithm=remax", "algorithm.baseline=none"], ["algorithm.baseline"]),
        (["algorithm=grpo", "minibatch_size=6"], ["minibatch_size", "samples_per_prompt"]),
        (["algorithm=grpp"], ["algorithm", "Did you mean 'grpo'"]),
        (["algorithm=grpo", "algorithm.policy_loss=ppo_clipp"], ["algorithm.policy_loss", "ppo_clip"]),
        (["algorithm=grpo", "algorithm.advantage=gae"], ["algorithm.advantage = 'gae' needs a value model"]),
        (["algorithm=grpo", "algorithm.kl.cof=1"], ["algorithm.kl.cof", "Did you mean 'algorithm.kl.coef'"]),
        (["rollout.max_staleness=1", "rollout.replay=somewhere"], ["rollout.max_staleness", "rollout.replay"]),
        (["rollout.max_staleness=-1"], ["rollout.max_staleness"]),
    ],
)
def test_invalid_combinations_are_refused_naming_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as error:
        load_rl_config(None, [*TINY, *SMALL, *overrides])
    for field in fields:
        assert field in str(error.value)


def test_one_step_off_policy_brings_max_staleness_1_which_the_config_may_override():
    assert load_rl_config(None, [*TINY, *SMALL, "algorithm=one_step_off_policy"]).rollout.max_staleness == 1
    override = ["algorithm=one_step_off_policy", "rollout.max_staleness=3"]
    assert load_rl_config(None, [*TINY, *SMALL, *override]).rollout.max_staleness == 3
    assert load_rl_config(None, [*TINY, *SMALL, "algorithm=grpo"]).rollout.max_staleness == 0


def test_critic_loss_coef_other_than_1_is_refused_with_the_reason():
    # the critic has its own AdamW, which cancels a constant scale of its loss: the key did nothing
    with pytest.raises(ConfigError) as error:
        load_rl_config(None, [*TINY, *SMALL, "algorithm=ppo", "algorithm.critic.loss_coef=0.5"])
    message = str(error.value)
    assert "algorithm.critic.loss_coef" in message and "algorithm.critic.learning_rate" in message
    assert "scale" in message
    config = load_rl_config(None, [*TINY, *SMALL, "algorithm=ppo", "algorithm.critic.loss_coef=1"])
    assert config.algorithm.critic.loss_coef == 1.0


def test_preset_fields_can_be_overridden_in_any_order(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("algorithm:\n  preset: grpo\n  kl: {coef: 0.5}\n")
    config = load_rl_config(config_file, [*TINY, *SMALL, "algorithm.entropy_coef=0.01"])
    assert config.algorithm.kl.placement == "loss" and config.algorithm.kl.coef == 0.5
    assert config.algorithm.entropy_coef == 0.01
    # a preset on the command line replaces the file's algorithm section, then sub-keys apply
    config = load_rl_config(config_file, [*TINY, *SMALL, "algorithm.entropy_coef=0.01", "algorithm=dapo"])
    assert config.algorithm.preset == "dapo" and config.algorithm.kl.placement == "none"
    assert config.algorithm.entropy_coef == 0.01


def test_preflight_stops_a_constant_reward_and_names_it(tmp_path):
    run = make_run(tmp_path, ["steps=1"], rewards=(constant,))
    with pytest.raises(RewardPreflightError) as error:
        run.run()
    message = str(error.value)
    assert "'constant'" in message and "same value 0.5" in message and "allow_constant_reward" in message
    assert "prompt 'Reverse the name" in message  # shows inputs and outputs
    run = make_run(tmp_path, ["steps=1", "allow_constant_reward=[constant]"], rewards=(constant, vowel_share))
    assert len(run.run()) == 1


def test_preflight_stops_a_reward_that_never_applies(tmp_path):
    def never(prompts, completions, completion_ids, **columns):
        return [None] * len(completions)

    run = make_run(tmp_path, ["steps=1"], rewards=(never,))
    with pytest.raises(RewardPreflightError, match="'never' returned None"):
        run.run()


def test_a_reward_that_raises_is_named(tmp_path):
    def broken(prompts, completions, completion_ids, **columns):
        raise KeyError("answer")

    run = make_run(tmp_path, ["steps=1"], rewards=(broken,))
    with pytest.raises(Exception, match="'broken' raised KeyError"):
        run.run()


def test_reward_functions_receive_every_dataset_column(tmp_path):
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(columns)
        seen["ids"] = completion_ids
        return vowel_share(prompts, completions, completion_ids)

    make_run(tmp_path, ["steps=1"], rewards=(spy,)).run()
    assert set(seen) == {"name", "ids"}
    assert len(seen["name"]) == 16 and all(isinstance(i, list) for i in seen["ids"])


def test_resumed_run_repeats_the_straight_run_exactly(tmp_path):
    common = ["algorithm=grpo", "steps=4", "save_every=2", "minibatch_size=8", "ppo_epochs=2"]
    straight = make_run(tmp_path, common, name="straight").run()
    first = make_run(tmp_path, [*common, "steps=4"], name="resumed")
    # stop after step 2 by running a copy configured for 2 steps into the same directory
    first_config = first.config.model_copy(update={"steps": 2})
    OnlineRL(first_config, reward_functions=[vowel_share], echo=lambda line: None).run()
    resumed = make_run(tmp_path, [*common, "resume=auto"], name="resumed").run()
    assert [h["step"] for h in resumed] == [3, 4]
    for key in ("reward/mean", "loss/policy", "policy/grad_norm", "kl/ref", "policy/approx_kl"):
        assert [h[key] for h in resumed] == [h[key] for h in straight[2:]], key
    records = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3, 4]


def test_dynamic_sampling_trains_only_on_groups_with_signal(tmp_path):
    run = make_run(tmp_path, ["algorithm=dapo", "algorithm.overlong.enabled=false", "steps=1"], rewards=(has_dot,))
    batch, metrics = run.source.next_batch(1)
    stats = {}
    for group, score in zip(batch.group_ids.tolist(), batch.scores.tolist(), strict=True):
        stats.setdefault(group, set()).add(score)
    assert all(len(values) > 1 for values in stats.values())
    assert metrics["dynamic_sampling/kept_groups"] == len(stats) <= 4


def test_reward_rises_on_an_easy_task(tmp_path):
    run = make_run(
        tmp_path,
        ["algorithm=grpo", "algorithm.kl.placement=none", "algorithm.kl.coef=0", "steps=40", "learning_rate=3e-3"],
    )
    history = run.run()
    early = sum(h["reward/mean"] for h in history[:5]) / 5
    late = sum(h["reward/mean"] for h in history[-5:]) / 5
    assert late > early + 0.15, (early, late)


def test_kl_monitor_measures_the_drift_of_a_run_that_does_not_optimise_it(tmp_path):
    base = ["algorithm=grpo", "algorithm.kl.placement=none", "algorithm.kl.coef=0", "steps=6", "learning_rate=3e-3"]
    watched = make_run(tmp_path, [*base, "algorithm.kl.monitor=true"], name="watched").run()
    unwatched = make_run(tmp_path, base, name="unwatched").run()
    assert all("kl/ref" not in h for h in unwatched)
    assert watched[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # sampled from the reference itself
    assert watched[-1]["kl/ref"] > 1e-4  # the policy has moved away from it
    # the KL is only watched: both runs make the same updates
    assert [h["reward/mean"] for h in watched] == pytest.approx([h["reward/mean"] for h in unwatched], abs=1e-5)


def test_the_logged_reward_kl_is_what_the_adaptive_controller_sees(tmp_path):
    # kl/ref (k3 of the updated policy) used to overwrite the controller's input under one name
    overrides = ["algorithm=grpo", "algorithm.kl.placement=reward", "algorithm.kl.estimator=k1"]
    overrides += ["algorithm.kl.coef=0.05", "algorithm.kl.controller=adaptive", "algorithm.kl.target=0.001"]
    overrides += ["algorithm.kl.horizon=40", "steps=4", "learning_rate=3e-3"]
    run = make_run(tmp_path, overrides)
    seen: list[float] = []
    update = run.kl_controller.update

    def recording_update(current_kl: float, n_steps: int) -> float:
        seen.append(current_kl)
        return update(current_kl, n_steps)

    run.kl_controller.update = recording_update
    history = run.run()
    assert [h["kl/reward"] for h in history] == seen
    assert abs(seen[-1]) > 1e-4  # the policy has moved: k1 of the rollout policy, which can be < 0
    assert history[-1]["kl/ref"] != seen[-1]  # k3 of the trained policy: a different number
    for before, after in itertools.pairwise(history):  # β_{t+1} = β_t·(1 + clip(KL_t/target − 1, ±0.2)·n/H)
        error = min(max(before["kl/reward"] / 0.001 - 1.0, -0.2), 0.2)
        assert after["kl/coef"] == pytest.approx(before["kl/coef"] * (1 + error * 16 / 40))


def test_the_critic_passes_honour_micro_batch_size(tmp_path):
    # the critic's value pass over the rollout batch used to run all 16 samples at once
    base = ["algorithm=ppo", "steps=2", "ppo_epochs=2", "minibatch_size=8"]
    whole = make_run(tmp_path, base, name="whole").run()
    chunked_run = make_run(tmp_path, [*base, "micro_batch_size=4"], name="chunked")
    sizes: list[int] = []
    chunked_run.critic.register_forward_hook(
        lambda module, args, kwargs, out: sizes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    chunked = chunked_run.run()
    assert sizes and max(sizes) == 4
    for key in ("reward/mean", "loss/value", "loss/policy", "policy/grad_norm"):
        assert [h[key] for h in chunked] == pytest.approx([h[key] for h in whole], rel=1e-4, abs=1e-6), key


def test_evaluation_reports_each_reward_including_weight_zero_monitors(tmp_path):
    overrides = ["eval_size=9", "steps=1", "reward_weights=[1.0,0.0]"]
    run = make_run(tmp_path, overrides, rewards=(vowel_share, has_dot))
    metrics = run.evaluate()
    shares = [vowel_share(None, [s["completion"]], None)[0] for s in run.last_eval.samples]
    dots = [has_dot(None, [s["completion"]], None)[0] for s in run.last_eval.samples]
    assert metrics["eval/vowel_share/mean"] == pytest.approx(sum(shares) / len(shares))
    assert metrics["eval/has_dot/mean"] == pytest.approx(sum(dots) / len(dots))
    assert metrics["eval/reward"] == pytest.approx(metrics["eval/vowel_share/mean"])  # weight 0: not in the sum
    # full marks, apart from partial credit: a share is solved only at 1.0, a 0/1 reward is its mean
    assert metrics["eval/vowel_share/solved"] == pytest.approx(sum(v >= 1.0 for v in shares) / len(shares))
    assert metrics["eval/has_dot/solved"] == pytest.approx(metrics["eval/has_dot/mean"])


def never(prompts, completions, completion_ids, **columns):
    return [0.0] * len(completions)


def test_eval_k_reports_pass_at_k_over_that_many_sampled_completions_per_prompt(tmp_path):
    calls: list[tuple[list, list[float]]] = []

    def half_vowels(prompts, completions, completion_ids, **columns):  # 0/1, passed about half the time
        scores = [float(share >= 0.5) for share in vowel_share(prompts, completions, completion_ids)]
        calls.append((list(prompts), scores))
        return scores

    run = make_run(tmp_path, ["eval_size=9", "preflight=false", "eval_k=4", "temperature=1.5"], rewards=(half_vowels,))
    metrics = run.evaluate()
    assert [len(scores) for _, scores in calls] == [9, 36]  # greedy, then 4 samples of each prompt
    prompts, scores = calls[1]
    assert all(len(set(prompts[i * 4 : i * 4 + 4])) == 1 for i in range(9))
    passed = [max(scores[i * 4 : i * 4 + 4]) == 1.0 for i in range(9)]
    assert metrics["eval/pass_at_k"] == pytest.approx(sum(passed) / 9)
    assert metrics["eval/mean_at_k"] == pytest.approx(sum(scores) / 36)  # equal samples per prompt
    assert metrics["eval/mean_at_k"] < metrics["eval/pass_at_k"]  # some prompt passed with fewer than 4 of 4
    assert 0 < sum(passed) < 9  # a figure that tells prompts apart, not all-or-nothing
    assert "eval/pass_at_k" not in make_run(tmp_path, ["eval_size=9", "preflight=false"], name="greedy").evaluate()


class ShiftedEngine:
    """The real engine, reporting every sampled token's log-prob ``shift`` lower than it was."""

    def __init__(self, engine, shift):
        self.engine, self.shift = engine, shift

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        rollouts = self.engine.generate(prompts, sampling)
        rollouts.logprobs = rollouts.logprobs - self.shift * rollouts.response_mask
        return rollouts


def test_areal_weighs_each_token_by_proximal_over_the_engines_behaviour_policy(tmp_path):
    base = ["algorithm=areal", "steps=2", "minibatch_size=8", "preflight=false"]
    straight = make_run(tmp_path, base, name="straight")
    history = straight.run()
    # the engine is the trainer's weights: w = π_prox/π_behav is 1 up to rounding, nothing masked
    assert all(h["policy/behaviour_masked_fraction"] == 0.0 for h in history)
    assert all(abs(h["policy/behaviour_weight_mean"] - 1) < 1e-4 for h in history)
    # an engine whose tokens were 10x less likely than π_prox says: every weight is 10 > cap 5
    stale = make_run(tmp_path, base, name="stale")
    stale.source.engine = ShiftedEngine(stale.source.engine, math.log(10.0))
    for record in stale.run():
        assert record["policy/behaviour_masked_fraction"] == 1.0 and record["loss/policy"] == 0.0
        assert record["policy/behaviour_weight_mean"] == pytest.approx(10.0, rel=1e-3)


def test_areal_without_behaviour_weights_is_ppo_clip_around_the_step_start_policy(tmp_path):
    common = ["steps=2", "minibatch_size=8", "preflight=false", "algorithm.agg_mode=token-mean"]
    decoupled = make_run(
        tmp_path, [*common, "algorithm=areal", "algorithm.loss_options.behaviour_weight=none"], name="decoupled"
    )
    no_kl = ["algorithm.kl.placement=none", "algorithm.kl.coef=0"]
    clipped = make_run(tmp_path, [*common, "algorithm=grpo", *no_kl], name="clipped")
    first, second = decoupled.run(), clipped.run()
    assert [h["loss/policy"] for h in first] == pytest.approx([h["loss/policy"] for h in second], abs=1e-7)
    for a, b in zip(decoupled.policy.parameters(), clipped.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accuracy_is_reported_for_one_0_1_reward_not_for_a_sum_that_happens_to_be_0_1(tmp_path):
    one = make_run(tmp_path, ["eval_size=9", "preflight=false"], rewards=(has_dot,), name="one")
    two = make_run(tmp_path, ["eval_size=9", "preflight=false"], rewards=(has_dot, never), name="two")
    assert "eval/accuracy" in one.evaluate() and "reward/accuracy" in one.step(1)[0]
    assert "eval/accuracy" not in two.evaluate() and "reward/accuracy" not in two.step(1)[0]


def test_cli_runs_a_yaml_config_with_a_user_reward_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "rl_cli_rewards.py").write_text(
        textwrap.dedent(
            """
            def vowels(prompts, completions, completion_ids, **columns):
                return [sum(c in "aeiou" for c in t) / max(len(t), 1) for t in completions]
            """
        )
    )
    (tmp_path / "rl.yaml").write_text(
        textwrap.dedent(
            """
            model: {tiny: {layers: 1, hidden: 32, heads: 2}}
            data: {task: reverse, n_train: 64, n_eval: 9}
            rewards: [rl_cli_rewards:vowels]
            algorithm: rloo
            steps: 2
            prompts_per_step: 4
            samples_per_prompt: 4
            max_new_tokens: 6
            eval_size: 9
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    assert main(["rl", "--config", "rl.yaml", "output_dir=out", "algorithm.kl.coef=0.1"]) == 0
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert "eval/reward" in records[0] and "reward/vowels/mean" in records[1]
    assert (tmp_path / "out" / "report.html").is_file() and (tmp_path / "out" / "samples.jsonl").is_file()
    config_text = (tmp_path / "out" / "config.yaml").read_text()
    assert "preset: rloo" in config_text and "coef: 0.1" in config_text


def test_cli_refuses_a_bad_rl_config_before_loading_a_model(tmp_path, capsys):
    assert main(["rl", "model.path=/nonexistent", "data.task=reverse", "algorithm=ppo", "algorithm.critic=null"]) == 2
    assert "needs a value model" in capsys.readouterr().err


@pytest.mark.parametrize("beta_zero", [False, True])
def test_the_shipped_rlhf_ppo_config_validates_with_and_without_the_kl_penalty(beta_zero):
    overrides = ["algorithm.kl.placement=none", "algorithm.kl.coef=0", "algorithm.kl.controller=fixed"]
    config = load_rl_config("configs/rlhf_ppo.yaml", overrides if beta_zero else [])
    assert config.algorithm.advantage == "gae" and config.algorithm.critic is not None
    assert config.algorithm.kl.needs_reference  # monitored even at β = 0
    assert config.reward_weights == [1.0, 0.0]


def test_the_shipped_rl_config_validates():
    config = load_rl_config("configs/reverse_grpo.yaml")
    assert config.algorithm.preset == "grpo" and config.algorithm.kl.placement == "none"
    assert config.sampling.stop == ["."] and config.rollout_batch_size == 256


# ---- silent wrong answers: an infinite reward, and missing scores under GDPO and ReMax ----


def inf_for_sample_3(prompts, completions, completion_ids, **columns):
    return [math.inf if i == 3 else 0.5 for i in range(len(completions))]


def test_a_reward_returning_inf_stops_the_run_naming_it(tmp_path, capsys):
    run = make_run(tmp_path, ["steps=2"], rewards=(vowel_share, inf_for_sample_3))
    with pytest.raises(RewardFunctionError, match=r"'inf_for_sample_3' returned inf for completion 3\b"):
        run.run()
    assert not (tmp_path / "run" / "final").exists()


def none_for_one_in_four(prompts, completions, completion_ids, **columns):
    """Scores samples 0, 2, 3 of each group of 4; sample 1 gets None (as a failed check would)."""
    return [None if i % 4 == 1 else float("." in text) for i, text in enumerate(completions)]


def trained_batches(run):
    """The batches `update` receives (the samples the step trains on)."""
    seen, update = [], run.update

    def spy(batch, step):
        seen.append(batch)
        return update(batch, step)

    run.update = spy
    return seen


def test_gdpo_does_not_train_a_sample_whose_component_is_missing_as_0(tmp_path):
    run = make_run(tmp_path, ["algorithm=gdpo", "steps=1"], rewards=(vowel_share, none_for_one_in_four))
    seen = trained_batches(run)
    history = run.run()
    assert history[0]["reward/unscored_dropped"] == 4  # one sample of each of the 4 groups
    (batch,) = seen
    assert len(batch) == 12 and not batch.reward_components.isnan().any()
    assert torch.isfinite(batch.advantages).all()


def none_for_the_greedy_of_the_first_prompt(prompts, completions, completion_ids, **columns):
    """ReMax scores one greedy completion per prompt (4 here, 16 samples otherwise): the first
    prompt's greedy completion gets None."""
    shares = vowel_share(prompts, completions, completion_ids)
    return [None, *shares[1:]] if len(completions) == 4 else shares


def test_remax_does_not_use_a_missing_greedy_baseline_as_0(tmp_path):
    run = make_run(tmp_path, ["algorithm=remax", "steps=1"], rewards=(none_for_the_greedy_of_the_first_prompt,))
    seen = trained_batches(run)
    history = run.run()
    assert history[0]["reward/baseline_missing_dropped"] == 4  # the first prompt's group, not A = r − 0
    (batch,) = seen
    assert len(batch) == 12 and batch.group_ids.unique().numel() == 3
    assert not batch.baseline_scores.isnan().any()


def none_for_three_in_four(prompts, completions, completion_ids, **columns):
    return [vowel_share(None, [text], None)[0] if i % 4 == 0 else None for i, text in enumerate(completions)]


def test_a_reward_missing_for_most_samples_stops_the_run_unless_allowed(tmp_path):
    run = make_run(tmp_path, ["steps=1"], rewards=(none_for_three_in_four,))
    with pytest.raises(RewardFunctionError, match=r"'none_for_three_in_four' gave no score for 12 of 16 samples"):
        run.run()
    run = make_run(tmp_path, ["steps=1", "reward_max_failed_fraction=1"], rewards=(none_for_three_in_four,), name="ok")
    history = run.run()
    assert history[0]["reward/unscored_dropped"] == 12
    assert history[0]["reward/none_for_three_in_four/failed_fraction"] == 0.75


def huge(prompts, completions, completion_ids, **columns):
    """Finite rewards whose group mean overflows float32: GRPO's advantages become NaN."""
    return [-3e38 if i % 4 == 3 else 3e38 for i in range(len(completions))]


def test_non_finite_advantages_stop_the_run_instead_of_skipping_their_samples(tmp_path):
    run = make_run(tmp_path, ["steps=1"], rewards=(huge,))
    with pytest.raises(TrainingDiverged, match=r"advantages of this batch are not finite .*scale of the rewards"):
        run.run()


def none_in_an_otherwise_constant_first_group(prompts, completions, completion_ids, **columns):
    """The first group of each round scores [1, 1, None, 1]: no signal once the None is masked."""
    shares = vowel_share(prompts, completions, completion_ids)
    return [(None if i == 2 else 1.0) if i < 4 else share for i, share in enumerate(shares)]


def test_dynamic_sampling_does_not_read_a_missing_score_as_0(tmp_path):
    overrides = ["algorithm=dapo", "algorithm.overlong.enabled=false", "steps=1"]
    run = make_run(tmp_path, overrides, rewards=(none_in_an_otherwise_constant_first_group,))
    batch, _ = run.source.next_batch(1)
    stats = {}
    for group, score in zip(batch.group_ids.tolist(), batch.scores.tolist(), strict=True):
        if not math.isnan(score):
            stats.setdefault(group, set()).add(score)
    assert stats and all(len(values) > 1 for values in stats.values())  # [1, 1, 1] is no signal
