"""Registry behaviour, documentation of every entry, and the import boundary of posttrain.algos."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from posttrain.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PREFERENCE_LOSSES, Registry, UnknownNameError

REQUIRED_ESTIMATORS = {
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "remax",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gpg",
    "gdpo",
}
REQUIRED_LOSSES = {"ppo_clip", "gspo", "gspo_token", "cispo", "sapo", "pg", "decoupled_ppo"}
ALL_ENTRIES = [
    (registry.kind, name, fn)
    for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PREFERENCE_LOSSES)
    for name, fn in registry.items()
]


def test_contract_names_are_registered():
    assert set(ADVANTAGE_ESTIMATORS) >= REQUIRED_ESTIMATORS
    assert set(POLICY_LOSSES) >= REQUIRED_LOSSES


def test_unknown_name_lists_valid_names_and_suggests_the_closest():
    with pytest.raises(UnknownNameError) as error:
        ADVANTAGE_ESTIMATORS["grp0"]
    message = str(error.value)
    assert "unknown advantage estimator 'grp0'" in message
    assert all(name in message for name in REQUIRED_ESTIMATORS)
    assert "Did you mean 'grpo'?" in message
    with pytest.raises(KeyError, match="ppo_clip"):  # still a KeyError for dict-minded callers
        POLICY_LOSSES["ppo"]


def test_duplicate_registration_is_refused_and_keeps_the_original():
    original = ADVANTAGE_ESTIMATORS["grpo"]
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda **_: None)
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES["pg"] = lambda **_: None
    assert ADVANTAGE_ESTIMATORS["grpo"] is original


def test_a_new_entry_gets_only_the_inputs_it_declares_and_typos_still_fail():
    registry = Registry("advantage estimator", standard_inputs=("token_rewards", "response_mask", "values"))

    @registry.register("constant")
    def constant(token_rewards, response_mask, *, value: float = 1.0):
        """A_t = value. Source: a test, 2026."""
        return response_mask * value, response_mask * value

    mask = torch.ones(1, 2)
    advantages, _ = registry["constant"](token_rewards=mask, response_mask=mask, values=mask, value=2.0)
    assert advantages.tolist() == [[2.0, 2.0]]
    with pytest.raises(TypeError, match="valeu"):
        registry["constant"](token_rewards=mask, response_mask=mask, valeu=2.0)


def test_a_missing_input_is_named():
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="needs values"):
        ADVANTAGE_ESTIMATORS["gae"](token_rewards=mask, response_mask=mask)
    with pytest.raises(ValueError, match="needs group_ids"):
        ADVANTAGE_ESTIMATORS["grpo"](token_rewards=mask, response_mask=mask)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        POLICY_LOSSES["decoupled_ppo"](logprobs=mask, old_logprobs=mask, advantages=mask, response_mask=mask)


@pytest.mark.parametrize(("kind", "name", "fn"), ALL_ENTRIES, ids=[f"{k}:{n}" for k, n, _ in ALL_ENTRIES])
def test_docstring_states_formula_and_source(kind, name, fn):
    doc = fn.__doc__ or ""
    assert "=" in doc, f"{kind} {name!r}: no formula in the docstring"
    assert re.search(r"Sources?:.*\b(19|20)\d\d\b", doc, re.S), f"{kind} {name!r}: no 'Source: <paper>, <year>'"


def test_importing_the_math_pulls_in_no_heavy_stack():
    code = (
        "import sys, posttrain.algos; "
        "heavy = {m.split('.')[0] for m in sys.modules} & {'transformers', 'ray', 'vllm', 'datasets', 'peft'}; "
        "print(sorted(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_public_signatures_of_design_md_hold():
    """docs/design.md's contract, called exactly as it is written there."""
    import posttrain.algos as algos

    logp, ref, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    assert algos.kl_estimate(logp, ref, "k1").shape == (1, 2)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert algos.aggregate_loss(logp, mask, mode).dim() == 0
    chosen, rejected = torch.tensor([-1.0]), torch.tensor([-2.0])
    loss, metrics = algos.dpo_loss(chosen, rejected, chosen, rejected, 0.1, "sigmoid")
    assert loss.dim() == 0 and "rewards/margin" in metrics
    loss, metrics = algos.bradley_terry_loss(chosen, rejected, None)
    assert loss.dim() == 0 and "accuracy" in metrics
    advantages, returns = algos.ADVANTAGE_ESTIMATORS["grpo"](
        token_rewards=mask,
        response_mask=mask,
        group_ids=torch.tensor([0]),
        values=None,
        baseline_scores=None,
        reward_components=None,
    )
    assert advantages.shape == returns.shape == (1, 2)


def test_losses_aggregate_with_their_papers_mode_by_default():
    assert {name: fn.default_agg_mode for name, fn in POLICY_LOSSES.items()} == {
        "ppo_clip": "token-mean",
        "gspo": "seq-mean-token-mean",
        "gspo_token": "seq-mean-token-mean",
        "cispo": "token-mean",
        "sapo": "seq-mean-token-mean",
        "pg": "token-mean",
        "decoupled_ppo": "token-mean",
    }
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages = torch.ones(2, 3)
    per_token, _ = POLICY_LOSSES["pg"].per_token(logprobs, logprobs, advantages, mask)
    assert per_token.tolist() == [[1.0, 2.0, 3.0], [1.0, 0.0, 0.0]]
    loss, _ = POLICY_LOSSES["pg"](logprobs, logprobs, advantages, mask, agg_mode="seq-mean-token-sum")
    assert loss.item() == (6.0 + 1.0) / 2


def test_estimators_declare_what_they_need_from_a_run():
    needs = ADVANTAGE_ESTIMATORS.needs
    groups = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gpg", "gdpo"}
    assert {name for name in REQUIRED_ESTIMATORS if needs[name].groups} == groups
    assert [name for name in REQUIRED_ESTIMATORS if needs[name].values] == ["gae"]
    assert needs["remax"].baselines == ("greedy",) and needs["remax"].baseline_required
    assert set(needs["reinforce"].baselines) == {"greedy", "running_mean"} and not needs["reinforce"].baseline_required
    assert [name for name in REQUIRED_ESTIMATORS if needs[name].reward_weights] == ["gdpo"]
    assert POLICY_LOSSES.declares("decoupled_ppo", "proximal_logprobs")
    assert {n for n in REQUIRED_LOSSES if POLICY_LOSSES.declares(n, "weights")} == {"ppo_clip", "pg"}


@pytest.fixture
def registered_estimator():
    """A third-party estimator registered for one test (a group baseline that needs a critic)."""
    from posttrain.algos import register_advantage

    @register_advantage("test_group_critic", groups=True, values=True)
    def test_group_critic(token_rewards, response_mask, group_ids=None, values=None):
        return token_rewards - values, token_rewards

    yield "test_group_critic"
    dict.pop(ADVANTAGE_ESTIMATORS, "test_group_critic")
    ADVANTAGE_ESTIMATORS.needs.pop("test_group_critic")


def test_the_config_checks_read_a_new_estimators_declaration(registered_estimator):
    # no name of it anywhere in the loop or the checks: its declaration alone decides
    from posttrain.config import ConfigError
    from posttrain.train.rl_config import load_rl_config

    base = ["model.tiny.layers=1", "data.task=reverse", f"algorithm.advantage={registered_estimator}"]
    with pytest.raises(ConfigError) as error:
        load_rl_config(None, [*base, "samples_per_prompt=1", "prompts_per_step=8"])
    assert f"'{registered_estimator}' needs a value model" in str(error.value)
    assert "samples_per_prompt must be >= 2" in str(error.value)
    config = load_rl_config(None, [*base, "algorithm.critic={}", "algorithm.dynamic_sampling.enabled=true"])
    assert config.algorithm.dynamic_sampling.enabled
    # dynamic sampling keeps groups with spread whatever the estimator (PPO's too), given groups
    ppo = ["model.tiny.layers=1", "data.task=reverse", "algorithm=ppo", "algorithm.dynamic_sampling.enabled=true"]
    assert load_rl_config(None, [*ppo, "samples_per_prompt=4"]).algorithm.dynamic_sampling.enabled
    with pytest.raises(ConfigError, match=r"dynamic_sampling keeps the groups .* samples_per_prompt must be >= 2"):
        load_rl_config(None, [*ppo, "samples_per_prompt=1", "prompts_per_step=8"])
