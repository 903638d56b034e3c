"""Multi-turn environments (docs/design.md, "Next"; issue 19): the contract and the guarded
caller (``base.py``), token-in/token-out episode assembly with the chat-template prefix check
(``episode.py``), and the built-ins ``support_bot``, ``calculator``, ``python`` and ``tools`` (plain Python
functions called in the model's own chat format: ``tool_env.py``, ``tool_formats.py``).

Importing this package registers the built-ins in :data:`ENVIRONMENTS`. The rollout source
that plays episodes with the engine is ``posttrain/sources/environment.py``.
"""

from posttrain.envs import calculator, python_tool, support_bot, tool_env  # noqa: F401  (registers the built-ins)
from posttrain.envs.base import (
    ENVIRONMENTS,
    Environment,
    EnvSpecError,
    EpisodeError,
    GuardedEnvironment,
    StepResult,
    register_environment,
    resolve_environment,
    run_concurrently,
)
from posttrain.envs.episode import Episode, EpisodeLimits, TemplatePrefixError

__all__ = [
    "ENVIRONMENTS",
    "EnvSpecError",
    "Environment",
    "Episode",
    "EpisodeError",
    "EpisodeLimits",
    "GuardedEnvironment",
    "StepResult",
    "TemplatePrefixError",
    "register_environment",
    "resolve_environment",
    "run_concurrently",
]
