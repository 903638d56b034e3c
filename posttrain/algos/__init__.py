"""The math of post-training, as pure functions over tensors (imports only torch).

Registries (docs/design.md, "Public contract of posttrain.algos"):

* :data:`ADVANTAGE_ESTIMATORS` — ``fn(token_rewards, response_mask, group_ids, values,
  baseline_scores, reward_components, **options) -> (advantages, returns)``, ``[B, T]``.
* :data:`POLICY_LOSSES` — ``fn(logprobs, old_logprobs, advantages, response_mask,
  **options) -> (loss, metrics)``.
* :data:`PREFERENCE_LOSSES` — the DPO family used by :func:`dpo_loss`.

Add an entry with ``@register_advantage("name")`` / ``@register_policy_loss("name")``.
"""

from posttrain.algos import advantages, decoupled, policy_losses, preference, returns  # noqa: F401  (registers)
from posttrain.algos.actor import actor_loss, entropy_from_logits
from posttrain.algos.decoupled import loglinear_proximal_logprobs
from posttrain.algos.groups import GroupStats, group_normalise, group_stats
from posttrain.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLControllerHorizon,
    AdaptiveKLControllerPPO,
    FixedKLController,
    kl_estimate,
    place_scores_at_last_token,
    shape_token_rewards,
)
from posttrain.algos.masked import (
    AGGREGATION_MODES,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from posttrain.algos.preference import bradley_terry_loss, chosen_nll, dpo_loss
from posttrain.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    BASELINES,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    Registry,
    UnknownNameError,
    register_advantage,
    register_baseline,
    register_policy_loss,
    register_preference_loss,
)
from posttrain.algos.returns import RunningMeanBaseline, discounted_returns, reinforce_returns
from posttrain.algos.sampling import dapo_group_filter, overlong_reward_penalty
from posttrain.algos.staleness import staleness_capacity
from posttrain.algos.supervised import sft_loss
from posttrain.algos.value import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "BASELINES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "AdaptiveKLControllerHorizon",
    "AdaptiveKLControllerPPO",
    "FixedKLController",
    "GroupStats",
    "Registry",
    "RunningMeanBaseline",
    "UnknownNameError",
    "actor_loss",
    "aggregate_loss",
    "bradley_terry_loss",
    "chosen_nll",
    "dapo_group_filter",
    "discounted_returns",
    "dpo_loss",
    "entropy_from_logits",
    "group_normalise",
    "group_stats",
    "kl_estimate",
    "loglinear_proximal_logprobs",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_reward_penalty",
    "place_scores_at_last_token",
    "register_advantage",
    "register_baseline",
    "register_policy_loss",
    "register_preference_loss",
    "reinforce_returns",
    "sft_loss",
    "shape_token_rewards",
    "staleness_capacity",
    "value_loss",
]
