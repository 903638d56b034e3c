"""The environment rollout source: each sample is a multi-turn episode (docs/design.md, "Next").

Per step it draws ``prompts_per_step`` rows and plays ``samples_per_prompt`` episodes of each
(a group = the episodes of one row, as GRPO/RLOO compare them). Every episode gets its own
environment instance (``env.name``/``env.options``), reset with the row. Turns are played in
lock-step over the episodes still going: one ``engine.generate`` call per turn continues each
episode's token ids (never re-tokenised: ``envs/episode.py``), then the environments answer,
``env.max_concurrent`` at a time (``envs/base.py:run_concurrently``).

The batch an episode becomes: the first observation is the prompt; everything after it is the
response, the policy's turns with ``response_mask`` 1 and the environment's tokens between
them with 0 (attended to: ``response_attention``); ``engine_logprobs`` on the sampled tokens;
each turn's reward on its last sampled token (``turn_rewards``). The score is the episode's
return: the turn rewards plus, when ``rewards=`` are configured, their score of the finished
conversation (the functions' ``completions`` are its messages after the first observation).
An environment that raises, hangs or answers malformed ends its episode as an error: counted
(``env/errors``), its score NaN, so batch preparation leaves it out of the loss; more than
``env.max_error_fraction`` of a batch stops the run naming the first error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.distributed import world
from posttrain.envs import EpisodeError, GuardedEnvironment, resolve_environment, run_concurrently
from posttrain.envs.episode import Episode, EpisodeLimits
from posttrain.envs.event_loop import EpisodeLoop
from posttrain.envs.section import EnvSection
from posttrain.errors import PosttrainError
from posttrain.rewards import RewardSet
from posttrain.rollout.types import SamplingParams
from posttrain.sources.single_turn import reward_metrics
from posttrain.train.rl_batch import RESERVED_COLUMNS, RolloutBatch
from posttrain.train.rl_config import RLRun
from posttrain.train.sampler import EpochSampler

Echo = Callable[[str], None]


class EnvironmentErrors(PosttrainError, RuntimeError):
    """More of a batch's episodes ended in environment errors than ``env.max_error_fraction``."""


@dataclass
class _Play:
    """One episode being played: its environment, its token state, the engine's log-probs of its
    sampled tokens (aligned with ``episode.ids``, 0 elsewhere) and its error, if any. With
    ``env.on_prefix_mismatch: new_sample`` an episode may be split: ``earlier`` holds its
    finished samples (each an :class:`Episode` and its log-probs), ``episode`` the current one.
    With an interruptible engine (``rollout.interrupt``) ``versions`` holds the weights version that
    sampled each token (aligned like the log-probs; ``earlier_versions`` for the earlier samples)."""

    env: GuardedEnvironment
    episode: Episode
    first_observation: Any
    logprobs: list[float] = field(default_factory=list)
    error: EpisodeError | None = None
    earlier: list[tuple[Episode, list[float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    earlier_versions: list[list[int]] = field(default_factory=list)

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
        self.episode = self.episode.next_sample()
        self.logprobs = [0.0] * len(self.episode.ids)
        self.versions = [self.versions[-1]] * len(self.episode.ids) if self.versions else []

    @property
    def sample_versions(self) -> list[list[int]]:
        """Per sample (as :attr:`samples`), the version of each token; empty lists when not tracked."""
        return [*self.earlier_versions, self.versions]

    def track(self, versions: list[int], length: int) -> None:
        """Append a turn's token ``versions``, then repeat the last for what follows up to ``length``
        (the environment's tokens, never trained on)."""
        self.versions.extend(versions)
        if self.versions:
            self.versions.extend([self.versions[-1]] * (length - len(self.versions)))


class EnvironmentSource:
    """Scored batches of multi-turn episodes (see the module docstring)."""

    def __init__(
        self,
        config: RLRun,
        env: EnvSection,
        engine: Any,
        tokenizer: Any,
        rows: Sequence[dict[str, Any]],
        rewards: RewardSet | None,
        context_limit: int | None,
        echo: Echo = print,
    ) -> None:
        self.config, self.env, self.engine, self.tokenizer = config, env, engine, tokenizer
        self.rows, self.rewards, self.echo = list(rows), rewards, echo
        self.factory = resolve_environment(env.name, env.options)
        total = env.max_total_tokens if env.max_total_tokens is not None else context_limit
        self.limits = EpisodeLimits(
            max_new_tokens=config.max_new_tokens, max_total_tokens=total, max_turns=env.max_turns, discount=env.discount
        )
        self.sampler = EpochSampler(len(self.rows), config.prompts_per_step, config.seed)
        self.ranks = world()  # under torchrun each rank plays its share of a step's rows (distributed.py)
        self.lowest_score = math.inf
        self.version = 0
        # an interruptible engine reports the version of every token (rollout.interrupt)
        self.tracks_versions = getattr(engine, "mailbox", None) is not None
        self.last_result: list[dict[str, Any]] = []
        self.episode_loop: EpisodeLoop | None = None  # made at the first episode: a thread does not pickle

    # ------------------------------------------------------------------ the RolloutSource protocol
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        rows = [self.rows[i] for i in self.ranks.share(self.sampler.next_batch(), "prompts_per_step")]
        t0 = time.perf_counter()
        plays = self._start([row for row in rows for _ in range(self.config.samples_per_prompt)])
        generate_s = self._play(plays, step, rank=self.ranks.rank)
        t1 = time.perf_counter()
        owners = [i for i, play in enumerate(plays) for _ in play.samples]  # each sample's episode
        batch = self._batch(plays, rows, owners)
        batch.group_ids += self.ranks.rank * len(rows)  # numbered as one process numbers them
        batch.scores = self._scores(plays, rows, owners, batch)
        t2 = time.perf_counter()
        self._check_errors(plays, step)
        metrics, self.lowest_score = reward_metrics(batch, False, self.lowest_score)
        metrics.update(_episode_metrics(plays))
        # the step warnings read this as "turns cut by max_new_tokens"; whole episodes cut by any
        # limit are env/truncated
        turns = sum(play.turns for play in plays)
        cut = sum(len(episode.cut_turns) for play in plays for episode, _ in play.samples)
        metrics["response/truncated_fraction"] = cut / max(turns, 1)
        metrics.update({"time/generate_s": generate_s, "time/env_s": t1 - t0 - generate_s, "time/reward_s": t2 - t1})
        metrics["throughput/generated_tokens_per_s"] = float(batch.response_mask.sum()) / max(generate_s, 1e-9)
        return batch, metrics

    def sync_weights(self, version: int) -> None:
        self.version = version
        self.engine.update_weights(version)

    def state_dict(self) -> dict[str, Any]:
        rewards = self.rewards.state_dict() if self.rewards is not None else {}
        return {"sampler": self.sampler.state_dict(), "rewards": rewards, "lowest_score": self.lowest_score}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.sampler.load_state_dict(state["sampler"])
        self.lowest_score = float(state.get("lowest_score", math.inf))
        if self.rewards is None:
            return []
        return [f"reward {name!r}" for name in self.rewards.load_state_dict(state.get("rewards", {}))]

    def start(self) -> None:
        if self.rewards is not None:
            self.rewards.start()

    def close(self) -> None:
        if self.episode_loop is not None:
            self.episode_loop.close()
        if self.rewards is not None:
            self.rewards.close()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Held-out episodes, one per row, the policy greedy: ``eval/reward`` (mean return),
        ``eval/turns_mean``, ``eval/errors``, ``eval/truncated``, and for environments that say
        whether an episode reached its goal ``eval/resolved`` and ``eval/turns_per_resolution``.
        With ``eval_k`` > 0, also ``eval_k`` episodes per row sampled at the run's temperature
        (the same draws at every evaluation): the same figures as ``eval/sampled_<name>`` — what
        the policy RL trains does, where a greedy bot hides how often it derails.
        ``rewards=`` functions are not run here: the return is the environment's rewards. The
        greedy episodes are kept in ``last_result`` (prompt, conversation, return, resolved, error)."""
        plays = self._evaluation_plays(rows, greedy=True)
        self.last_result = [_episode_record(play) for play in plays]
        metrics = {f"eval/{name}": value for name, value in _evaluation_metrics(plays).items()}
        if self.config.eval_k:
            sampled = self._evaluation_plays([row for row in rows for _ in range(self.config.eval_k)], greedy=False)
            metrics.update({f"eval/sampled_{name}": value for name, value in _evaluation_metrics(sampled).items()})
        return metrics

    def _evaluation_plays(self, rows: Sequence[dict[str, Any]], greedy: bool) -> list[_Play]:
        plays: list[_Play] = []
        for start in range(0, len(rows), self.config.eval_batch_size):
            chunk = self._start(rows[start : start + self.config.eval_batch_size])
            # step 0 is never a training step: sampled evaluations reuse one stream of draws
            self._play(chunk, step=0, greedy=greedy)
            plays += chunk
        return plays

    # ------------------------------------------------------------------ episodes
    def _start(self, rows: Sequence[dict[str, Any]]) -> list[_Play]:
        """A fresh environment per row, reset with it (``env.max_concurrent`` at a time)."""
        envs = [GuardedEnvironment(self.factory(), timeout_s=self.env.timeout_s, name=self.env.name) for _ in rows]
        calls = [lambda env=env, row=row: env.areset(dict(row)) for env, row in zip(envs, rows, strict=True)]
        firsts = self._concurrently(calls, turn=0)
        stop_ids = [self.tokenizer.eos_token_id]
        plays = []
        for env, first in zip(envs, firsts, strict=True):
            if isinstance(first, EpisodeError):
                episode = Episode.start(self.tokenizer, "", self.limits, stop_token_ids=stop_ids)
                plays.append(_Play(env, episode, "", error=first))
            else:
                episode = Episode.start(
                    self.tokenizer, first, self.limits, stop_token_ids=stop_ids,
                    on_prefix_mismatch=self.env.on_prefix_mismatch,
                )  # fmt: skip
                play = _Play(env, episode, first, logprobs=[0.0] * len(episode.ids))
                if episode.finished:  # the first observation fills the context: no turn can be sampled
                    play.error = self._no_room(len(episode.ids))
                if self.tracks_versions:
                    play.versions = [self.engine.policy_version] * len(episode.ids)
                plays.append(play)
        return plays

    def _no_room(self, length: int) -> EpisodeError:
        return EpisodeError(
            f"environment {self.env.name!r}: reset's observation is {length} tokens, which leaves no room for a "
            f"response within {self.limits.max_total_tokens} tokens (env.max_total_tokens, or the model's context): "
            "shorten the first observation or raise the limit",
            turn=0,
            kind="invalid",
        )

    def _concurrently(self, calls: list[Callable[[], Awaitable[Any]]], turn: int) -> list[Any]:
        """The environments' calls of one turn, on the source's event loop (``envs/event_loop.py``)."""
        if self.episode_loop is None:
            self.episode_loop = EpisodeLoop(f"env-{self.env.name}")
        what = f"environment {self.env.name!r}: " + ("reset" if turn == 0 else f"step of turn {turn}")
        return run_concurrently(
            calls, self.env.max_concurrent, loop=self.episode_loop, stall_s=self.env.timeout_s, what=what
        )

    def _play(self, plays: list[_Play], step: int, greedy: bool = False, rank: int = 0) -> float:
        """Play every episode to its end, a turn at a time; returns the seconds spent generating."""
        config, generate_s, turn = self.config, 0.0, 0
        while active := [play for play in plays if play.active]:
            turn += 1
            budgets = [play.episode.budget() for play in active]
            sampling = SamplingParams(
                n=1,
                max_new_tokens=max(budgets),  # each episode keeps its own budget's worth (below)
                temperature=config.temperature_value,
                top_p=config.sampling.top_p,
                top_k=config.sampling.top_k,
                greedy=greedy,
                stop_strings=tuple(config.sampling.stop),
                # from (seed, step, turn, rank): a resumed run plays exactly the same episodes
                seed=(config.seed * 1_000_003 + step * 1009 + turn * 7919 + rank * 7_919_317) % 2**62,
            )
            t0 = time.perf_counter()
            rollouts = self.engine.generate([play.episode.ids for play in active], sampling)
            generate_s += time.perf_counter() - t0
            lengths = rollouts.response_lengths.tolist()
            turn_versions = rollouts.extras.get("token_versions")
            stepping = []
            for i, (play, budget) in enumerate(zip(active, budgets, strict=True)):
                # the first tokens of a longer generation are what a shorter one would have sampled
                n = min(lengths[i], budget)
                text = play.episode.add_turn(rollouts.response_ids[i, :n].tolist())
                play.logprobs.extend(rollouts.logprobs[i, :n].tolist())
                if turn_versions is not None and play.versions:
                    play.track(turn_versions[i, :n].tolist(), len(play.episode.ids))
                if not play.episode.finished:  # else no room is left in max_total_tokens for more
                    stepping.append((play, text))
            calls = [lambda play=play, text=text: play.env.astep(text) for play, text in stepping]
            for (play, _), result in zip(stepping, self._concurrently(calls, turn), strict=True):
                if isinstance(result, EpisodeError):
                    play.error = result
                    continue
                play.episode.add_result(result.observation, result.reward, result.done)
                play.logprobs.extend([0.0] * (len(play.episode.ids) - len(play.logprobs)))
                play.track([], len(play.episode.ids))
                if play.episode.continues_as_new_sample:
                    play.continue_as_new_sample()
        return generate_s

    # ------------------------------------------------------------------ the batch
    def _batch(self, plays: list[_Play], rows: list[dict[str, Any]], owners: list[int]) -> RolloutBatch:
        """One sample per episode, or per sample of a split one (``on_prefix_mismatch:
        new_sample``): each of those carries its own turns and their rewards, shares the
        episode's group and is scored with the whole episode's return (``_scores``); ``owners``
        gives each sample's episode."""
        pad = self.engine.pad_id
        samples = [sample for play in plays for sample in play.samples]
        sample_versions = [versions for play in plays for versions in play.sample_versions]
        prompts = [episode.ids[: episode.prompt_length] for episode, _ in samples]
        responses = [episode.ids[episode.prompt_length :] for episode, _ in samples]
        width_p, width_t = max(len(p) for p in prompts), max(max(len(r) for r in responses), 1)
        b = len(samples)
        batch_tensors = {
            "prompt_ids": torch.full((b, width_p), pad, dtype=torch.long),
            "prompt_mask": torch.zeros(b, width_p, dtype=torch.long),
            "response_ids": torch.full((b, width_t), pad, dtype=torch.long),
            "response_mask": torch.zeros(b, width_t),
            "response_attention": torch.zeros(b, width_t, dtype=torch.long),
            "engine_logprobs": torch.zeros(b, width_t),
            "turn_rewards": torch.zeros(b, width_t),
        }
        if self.tracks_versions:
            batch_tensors["token_versions"] = torch.full((b, width_t), self.version, dtype=torch.long)
        rows_of = zip(samples, prompts, responses, sample_versions, strict=True)
        for i, ((episode, logprobs), prompt, response, versions) in enumerate(rows_of):
            start, n = episode.prompt_length, len(response)
            t = batch_tensors
            if prompt:
                t["prompt_ids"][i, width_p - len(prompt) :] = torch.tensor(prompt)
                t["prompt_mask"][i, width_p - len(prompt) :] = 1
            if n:
                t["response_ids"][i, :n] = torch.tensor(response)
                t["response_mask"][i, :n] = torch.tensor(episode.mask[start:], dtype=torch.float32)
                t["response_attention"][i, :n] = 1
                t["engine_logprobs"][i, :n] = torch.tensor(logprobs[start : start + n])
                t["turn_rewards"][i, :n] = torch.tensor(episode.token_rewards()[start:])
                if turn_versions := versions[start : start + n]:
                    t["token_versions"][i, : len(turn_versions)] = torch.tensor(turn_versions)
        group = self.config.samples_per_prompt
        names = list(dict.fromkeys(k for row in rows for k in row if k not in RESERVED_COLUMNS))
        return RolloutBatch(
            **batch_tensors,
            group_ids=torch.tensor(owners) // group,
            truncated=torch.tensor([episode.truncated for episode, _ in samples], dtype=torch.bool),
            policy_version=_oldest_versions(batch_tensors, self.version),
            prompts=[plays[i].first_observation for i in owners],
            completions=[_conversation(plays[i]) for i in owners],
            columns=_row_columns(rows, names, owners, group),
        )

    def _scores(
        self, plays: list[_Play], rows: list[dict[str, Any]], owners: list[int], batch: RolloutBatch
    ) -> torch.Tensor:
        """Each episode's return, on each of its samples: its turn rewards plus the ``rewards=``
        score of the conversation (NaN where a function has no score for it); NaN for an
        episode that ended in an error."""
        # an episode the environment gave no reward (its only turn cut by the budget) returns 0:
        # that is its return, as a single-turn completion cut short is still scored
        returns = torch.tensor([play.total_reward for play in plays], dtype=torch.float32)
        if self.rewards is not None:
            sampled_ids = [
                [t for episode, _ in play.samples for t, m in zip(episode.ids, episode.mask, strict=True) if m]
                for play in plays
            ]
            group = self.config.samples_per_prompt
            result = self.rewards.score(
                [play.first_observation for play in plays],
                [_conversation(play) for play in plays],
                sampled_ids,
                _row_columns(rows, batch.columns, range(len(plays)), group),
                group_ids=torch.arange(len(plays)) // group,
            )
            batch.reward_components = result.components[owners]
            returns = returns + result.scores
        errors = torch.tensor([play.error is not None for play in plays])
        return torch.where(errors, math.nan, returns)[owners]

    def _check_errors(self, plays: list[_Play], step: int) -> None:
        errors = [play.error for play in plays if play.error is not None]
        if errors and len(errors) == len(plays):  # whatever max_error_fraction allows: nothing is left to learn from
            raise EnvironmentErrors(
                f"step {step}: every one of the {len(plays)} episodes ended in an environment error, so the step has "
                f"nothing to train on. The first: {errors[0]}"
            )
        if errors and len(errors) / len(plays) > self.env.max_error_fraction:
            raise EnvironmentErrors(
                f"step {step}: {len(errors)} of {len(plays)} episodes ended in an environment error, more than "
                f"env.max_error_fraction = {self.env.max_error_fraction:g}. The first: {errors[0]}"
            )


def _row_columns(
    rows: list[dict[str, Any]], names: Sequence[str], episodes: Sequence[int], group: int
) -> dict[str, list[Any]]:
    """The dataset columns ``names`` for each of ``episodes`` (episode i plays row i // group)."""
    return {key: [rows[i // group].get(key) for i in episodes] for key in names}


def _oldest_versions(tensors: dict[str, torch.Tensor], version: int) -> torch.Tensor:
    """Each sample's policy version: the oldest that sampled one of its tokens when versions are
    tracked per token (rollout.interrupt), else ``version`` (the weights the batch started with)."""
    b = tensors["response_ids"].shape[0]
    if "token_versions" not in tensors:
        return torch.full((b,), version, dtype=torch.long)
    sampled = tensors["response_mask"].bool()
    oldest = tensors["token_versions"].masked_fill(~sampled, torch.iinfo(torch.long).max).amin(-1)
    return torch.where(sampled.any(-1), oldest, version) if b else oldest


def _conversation(play: _Play) -> list[dict[str, Any]]:
    """The conversation after the first observation: the policy's turns and the environment's."""
    first = play.first_observation
    return play.messages[len(first) if isinstance(first, list) else 1 :]


def _episode_record(play: _Play) -> dict[str, Any]:
    return {
        "prompt": play.first_observation,
        "conversation": _conversation(play),
        "return": play.total_reward,
        "resolved": getattr(play.env.env, "resolved", None),
        "truncated": play.truncated,
        "error": None if play.error is None else str(play.error),
    }


def _episode_metrics(plays: list[_Play]) -> dict[str, float]:
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
    return metrics


def _evaluation_metrics(plays: list[_Play]) -> dict[str, float]:
    """Evaluation figures of finished episodes: mean return (``reward``), turns, errors,
    truncation and, for environments that say so, ``resolved`` and ``turns_per_resolution``."""
    returns = [p.total_reward for p in plays if p.error is None and any(e.rewards for e, _ in p.samples)]
    metrics = {name.removeprefix("env/"): value for name, value in _episode_metrics(plays).items()}
    metrics["reward"] = sum(returns) / len(returns) if returns else math.nan
    if "resolved" in metrics:
        solved = [p for p in plays if getattr(p.env.env, "resolved", False)]
        turns = sum(p.turns for p in solved)
        metrics["turns_per_resolution"] = turns / len(solved) if solved else math.nan
    return metrics
