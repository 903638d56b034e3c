"""One environment episode being played (:class:`Play`), and what the environment source reads
of finished ones: their conversation, their records and metrics, their batch columns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.envs import EpisodeError, GuardedEnvironment
from posttrain.envs.episode import Episode


@dataclass
class Play:
    """One episode being played: its environment, its token state, the engine's log-probs of its
    sampled tokens (aligned with ``episode.ids``, 0 elsewhere) and its error, if any. With
    ``env.on_prefix_mismatch: new_sample`` an episode may be split: ``earlier`` holds its
    finished samples (each an :class:`Episode` and its log-probs), ``episode`` the current one.
    With an interruptible engine (``rollout.interrupt``) ``versions`` holds the weights version that
    sampled each token (aligned like the log-probs; ``earlier_versions`` for the earlier samples).
    With ``rollout.keep_sampling_mask`` ``kept`` maps the position of each sampled token in
    ``episode.ids`` to its kept set (``earlier_kept`` for the earlier samples)."""

    env: GuardedEnvironment
    episode: Episode
    first_observation: Any
    logprobs: list[float] = field(default_factory=list)
    error: EpisodeError | None = None
    earlier: list[tuple[Episode, list[float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    earlier_versions: list[list[int]] = field(default_factory=list)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    earlier_kept: list[dict[int, torch.Tensor]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.error is None and not self.episode.finished

    @property
    def samples(self) -> list[tuple[Episode, list[float]]]:
        """The batch samples of this episode: the earlier ones (each ends with a policy turn)
        and the current one (always, so that an episode that ended in an error is counted)."""
        return [*self.earlier, (self.episode, self.logprobs)]

    @property
    def total_reward(self) -> float:
        return sum(e.total_reward for e, _ in self.earlier) + self.episode.total_reward

    @property
    def turns(self) -> int:
        return self.episode.turn

    @property
    def truncated(self) -> bool:
        return any(e.truncated for e, _ in self.earlier) or self.episode.truncated

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.episode.messages  # a new sample starts from the whole conversation so far

    def continue_as_new_sample(self) -> None:
        """The template rewrote history (``on_prefix_mismatch: new_sample``): the episode goes on
        as a new sample whose prompt is the template's rendering of the conversation so far."""
        self.earlier.append((self.episode, self.logprobs))
        self.earlier_versions.append(self.versions)
        self.earlier_kept.append(self.kept)
        self.kept = {}
        self.episode = self.episode.next_sample()
        self.logprobs = [0.0] * len(self.episode.ids)
        self.versions = [self.versions[-1]] * len(self.episode.ids) if self.versions else []

    @property
    def sample_versions(self) -> list[list[int]]:
        """Per sample (as :attr:`samples`), the version of each token; empty lists when not tracked."""
        return [*self.earlier_versions, self.versions]

    @property
    def sample_kept(self) -> list[dict[int, torch.Tensor]]:
        """Per sample (as :attr:`samples`), the kept set of each sampled token by its position."""
        return [*self.earlier_kept, self.kept]

    def keep_masks(self, masks: torch.Tensor, start: int) -> None:
        """Record a turn's kept sets (``masks [n, K]``, rows of −1 padded ids) for its tokens at
        ``start``, ``start + 1``, … of ``episode.ids``."""
        for offset, ids in enumerate(masks):
            self.kept[start + offset] = ids[ids >= 0]

    def track(self, versions: list[int], length: int) -> None:
        """Append a turn's token ``versions``, then repeat the last for what follows up to ``length``
        (the environment's tokens, never trained on)."""
        self.versions.extend(versions)
        if self.versions:
            self.versions.extend([self.versions[-1]] * (length - len(self.versions)))


def row_columns(
    rows: list[dict[str, Any]], names: Sequence[str], episodes: Sequence[int], group: int
) -> dict[str, list[Any]]:
    """The dataset columns ``names`` for each of ``episodes`` (episode i plays row i // group)."""
    return {key: [rows[i // group].get(key) for i in episodes] for key in names}


def oldest_versions(tensors: dict[str, torch.Tensor], version: int) -> torch.Tensor:
    """Each sample's policy version: the oldest that sampled one of its tokens when versions are
    tracked per token (rollout.interrupt), else ``version`` (the weights the batch started with)."""
    b = tensors["response_ids"].shape[0]
    if "token_versions" not in tensors:
        return torch.full((b,), version, dtype=torch.long)
    sampled = tensors["response_mask"].bool()
    oldest = tensors["token_versions"].masked_fill(~sampled, torch.iinfo(torch.long).max).amin(-1)
    return torch.where(sampled.any(-1), oldest, version) if b else oldest


def conversation(play: Play) -> list[dict[str, Any]]:
    """The conversation after the first observation: the policy's turns and the environment's."""
    first = play.first_observation
    return play.messages[len(first) if isinstance(first, list) else 1 :]


def episode_record(
    play: Play, score: float | None = None, components: dict[str, float] | None = None
) -> dict[str, Any]:
    """An evaluated episode: its ``return`` (``score``, the environment's rewards plus the
    ``rewards=`` functions', when given; else the environment's alone), each function's score
    (``rewards``), and what the environment reports of it (``figures``, e.g. its tool calls)."""
    return {
        "prompt": play.first_observation,
        "conversation": conversation(play),
        "return": play.total_reward if score is None else score,
        "rewards": dict(components or {}) if play.error is None else {},
        "resolved": getattr(play.env.env, "resolved", None),
        "figures": play.env.env.episode_metrics() if play.error is None and _reports(play) else {},
        "truncated": play.truncated,
        "error": None if play.error is None else str(play.error),
    }


def episode_metrics(plays: list[Play]) -> dict[str, float]:
    n = len(plays)
    resolved = [bool(play.env.env.resolved) for play in plays if hasattr(play.env.env, "resolved")]
    metrics = {
        "env/turns_mean": sum(play.turns for play in plays) / n,
        "env/errors": sum(play.error is not None for play in plays) / n,
        "env/truncated": sum(play.truncated for play in plays) / n,
        "env/done": sum(play.episode.stop_reason == "done" for play in plays) / n,
    }
    if resolved:  # environments that say whether the episode reached its goal (support_bot does)
        metrics["env/resolved"] = sum(resolved) / len(resolved)
    return metrics | environment_metrics(plays)


def environment_metrics(plays: list[Play]) -> dict[str, float]:
    """The means over the episodes of what each environment says of its own episode
    (``episode_metrics()``, e.g. the tools environment's ``tools/calls_per_episode``); episodes
    that ended in an error are left out, as they are from the loss."""
    reports = [play.env.env.episode_metrics() for play in plays if play.error is None and _reports(play)]
    keys = list(dict.fromkeys(key for report in reports for key in report))
    return {key: sum(r[key] for r in reports if key in r) / sum(key in r for r in reports) for key in keys}


def _reports(play: Play) -> bool:
    return callable(getattr(play.env.env, "episode_metrics", None))


def evaluation_metrics(plays: list[Play], returns: list[float] | None = None) -> dict[str, float]:
    """Evaluation figures of finished episodes: mean return (``reward``: of ``returns`` when given,
    the episodes' scores with the ``rewards=`` functions', else of the environment's rewards, over
    the episodes it rewarded), turns, errors, truncation and, for environments that say so,
    ``resolved`` and ``turns_per_resolution``."""
    if returns is None:
        returns = [p.total_reward for p in plays if p.error is None and any(e.rewards for e, _ in p.samples)]
    returns = [r for r in returns if not math.isnan(r)]  # an episode that ended in an error has none
    metrics = {name.removeprefix("env/"): value for name, value in episode_metrics(plays).items()}
    metrics["reward"] = sum(returns) / len(returns) if returns else math.nan
    if "resolved" in metrics:
        solved = [p for p in plays if getattr(p.env.env, "resolved", False)]
        turns = sum(p.turns for p in solved)
        metrics["turns_per_resolution"] = turns / len(solved) if solved else math.nan
    return metrics
