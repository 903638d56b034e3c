"""Reward functions: rule-based checks, math answers, code run in a sandbox, reward models,
and how several are combined and run in parallel.

Importing this package registers the built-ins in :data:`REWARDS`.
"""

from posttrain.rewards import code, math_answer, model_reward, reasoning_gym, rules  # noqa: F401  (registers the built-ins)
from posttrain.rewards.compose import RewardFunctionError, RewardPoolWarning, RewardResult, RewardSet
from posttrain.rewards.registry import REWARDS, NamedReward, RewardOutput, register_reward, resolve_reward

__all__ = [
    "REWARDS",
    "NamedReward",
    "RewardFunctionError",
    "RewardOutput",
    "RewardPoolWarning",
    "RewardResult",
    "RewardSet",
    "register_reward",
    "resolve_reward",
]
