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
from typing import Any

import torch
from torch import Tensor

from posttrain.data.sampler import EpochSampler
from posttrain.distributed import world
from posttrain.envs import EpisodeError, GuardedEnvironment, resolve_environment, run_concurrently
from posttrain.envs.episode import Episode, EpisodeLimits
from posttrain.envs.event_loop import EpisodeLoop
from posttrain.envs.section import EnvSection
from posttrain.errors import PosttrainError
from posttrain.rewards import RewardSet
from posttrain.rewards.outputs import RewardFunctionError
from posttrain.rollout.batch import RESERVED_COLUMNS, RolloutBatch
from posttrain.sources.episodes import (
    Play,
    conversation,
    episode_metrics,
    episode_record,
    evaluation_metrics,
    oldest_versions,
    row_columns,
)
from posttrain.sources.plan import SamplingPlan, sample_seed

Echo = Callable[[str], None]


class EnvironmentErrors(PosttrainError, RuntimeError):
    """More of a batch's episodes ended in environment errors than ``env.max_error_fraction``."""


class EnvironmentSource:
    """Scored batches of multi-turn episodes (see the module docstring)."""

    def __init__(
        self,
        plan: SamplingPlan,
        env: EnvSection,
        engine: Any,
        tokenizer: Any,
        rows: Sequence[dict[str, Any]],
        rewards: RewardSet | None,
        context_limit: int | None,
        echo: Echo = print,
    ) -> None:
        self.plan, self.env, self.engine, self.tokenizer = plan, env, engine, tokenizer
        self.rows, self.rewards, self.echo = list(rows), rewards, echo
        self.factory = resolve_environment(env.name, env.options)
        total = env.max_total_tokens if env.max_total_tokens is not None else context_limit
        self.limits = EpisodeLimits(
            max_new_tokens=plan.max_new_tokens, max_total_tokens=total, max_turns=env.max_turns, discount=env.discount
        )
        self.sampler: Any = EpochSampler(len(self.rows), plan.prompts_per_step, plan.seed)  # a curriculum replaces it
        self.ranks = world()  # under torchrun each rank plays its share of a step's rows (distributed.py)
        self.group_rows: dict[int, dict[str, Any]] = {}  # the row of each group of the last draws (greedy_scores)
        self.version = 0
        # an interruptible engine reports the version of every token (rollout.interrupt)
        self.tracks_versions = getattr(engine, "mailbox", None) is not None
        self.last_result: list[dict[str, Any]] = []  # the last evaluation's episodes (evaluate)
        self.last_sampled: list[dict[str, Any]] = []
        self.last_played: list[dict[str, Any]] = []
        self.episode_loop: EpisodeLoop | None = None  # made at the first episode: a thread does not pickle

    single_reward = False  # the score is a return, never one 0/1 reward: no reward/accuracy

    @property
    def pad_id(self) -> int:
        return self.engine.pad_id

    @property
    def length_limit(self) -> int:
        """The most tokens the policy samples in one episode: ``max_turns`` turns of ``max_new_tokens``."""
        return self.env.max_turns * self.plan.max_new_tokens

    # ------------------------------------------------------------------ the RolloutSource protocol
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.sample(step)

    def sample(self, step: int, round_index: int = 0, group_offset: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        """Draw ``prompts_per_step`` rows and play ``samples_per_prompt`` episodes of each;
        ``round_index`` (dynamic sampling's further draws) and ``group_offset`` seed and number them."""
        rows = [self.rows[i] for i in self.ranks.share(self.sampler.next_batch(), "prompts_per_step")]
        group_offset += self.ranks.rank * len(rows)  # numbered as one process numbers them
        if round_index == 0:
            self.group_rows = {}
        self.group_rows.update({group_offset + i: row for i, row in enumerate(rows)})
        t0 = time.perf_counter()
        plays = self._start([row for row in rows for _ in range(self.plan.samples_per_prompt)])
        generate_s = self._play(plays, step, rank=self.ranks.rank, round_index=round_index)
        t1 = time.perf_counter()
        owners = [i for i, play in enumerate(plays) for _ in play.samples]  # each sample's episode
        batch = self._batch(plays, rows, owners)
        batch.group_ids += group_offset
        batch.scores = self._scores(plays, rows, owners, batch)
        t2 = time.perf_counter()
        self._check_errors(plays, step)
        metrics = episode_metrics(plays)
        self._check_malformed(plays, metrics.get("tools/malformed_fraction", 0.0), step)
        # the step warnings read this as "turns cut by max_new_tokens"; whole episodes cut by any
        # limit are env/truncated
        turns = sum(play.turns for play in plays)
        cut = sum(len(episode.cut_turns) for play in plays for episode, _ in play.samples)
        metrics["response/truncated_fraction"] = cut / max(turns, 1)
        metrics.update({"time/generate_s": generate_s, "time/env_s": t1 - t0 - generate_s, "time/reward_s": t2 - t1})
        metrics["throughput/generated_tokens_per_s"] = float(batch.response_mask.sum()) / max(generate_s, 1e-9)
        return batch, metrics

    def greedy_scores(self, batch: RolloutBatch) -> Tensor:
        """ReMax for episodes: the return of one greedy episode of each group's row, for every
        sample of the group (NaN where that episode ended in an error: the loop drops the group)."""
        groups, first = torch.unique(batch.group_ids, return_inverse=True)
        rows = [self.group_rows[int(group)] for group in groups]
        plays = self._start(rows)
        self._play(plays, step=0, greedy=True)
        return self._returns(plays, rows, group=1)[first]

    def measure(self, rows: Sequence[dict[str, Any]], k: int) -> list[list[float]]:
        """``k`` episodes of each row sampled at the run's temperature (the difficulty filter's
        measure): each row's returns, those of episodes that ended in an error left out."""
        plays = self._evaluation_plays([row for row in rows for _ in range(k)], greedy=False)
        returns = self._returns(plays, [row for row in rows for _ in range(k)], group=k).tolist()
        return [[r for r in returns[i * k : (i + 1) * k] if not math.isnan(r)] for i in range(len(rows))]

    def sync_weights(self, version: int) -> None:
        self.version = version
        self.engine.update_weights(version)

    def state_dict(self) -> dict[str, Any]:
        rewards = self.rewards.state_dict() if self.rewards is not None else {}
        return {"sampler": self.sampler.state_dict(), "rewards": rewards}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.sampler.load_state_dict(state["sampler"])
        if self.rewards is None:
            return []
        return [f"reward {name!r}" for name in self.rewards.load_state_dict(state.get("rewards", {}))]

    def start(self) -> None:
        if self.rewards is not None:
            self.rewards.start()

    def close(self) -> None:
        if self.episode_loop is not None:
            self.episode_loop.close()
            self.episode_loop = None  # episodes played after close() start a new one
        if self.rewards is not None:
            self.rewards.close()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Held-out episodes, one per row, the policy greedy, scored as training scores them (the
        environment's rewards plus the ``rewards=`` functions' score of the conversation):
        ``eval/reward`` (mean return), ``eval/turns_mean``, ``eval/errors``, ``eval/truncated``, what
        the environment reports of its episodes (e.g. ``eval/tools/calls_per_episode``), each
        function's ``eval/<name>/mean`` and ``/solved`` (full marks) and, for environments that say
        whether an episode reached its goal, ``eval/resolved`` and ``eval/turns_per_resolution``.
        With ``eval_k`` > 0, also ``eval_k`` episodes per row sampled at the run's temperature (the
        same draws at every evaluation): the same figures as ``eval/sampled_<name>`` — what the
        policy RL trains does, where a greedy bot hides how often it derails. The episodes' records
        (prompt, conversation, return, per-function scores, resolved, the environment's figures,
        error) are kept: the greedy ones in ``last_result``, the sampled ones in ``last_sampled``
        (row i's are ``eval_k * i`` to ``eval_k * (i + 1)``)."""
        metrics = self._scored(rows, greedy=True, prefix="eval/")
        self.last_result = self.last_played
        if self.plan.eval_k:
            sampled = [row for row in rows for _ in range(self.plan.eval_k)]
            metrics.update(self._scored(sampled, greedy=False, prefix="eval/sampled_"))
            self.last_sampled = self.last_played
        return metrics

    def _scored(self, rows: Sequence[dict[str, Any]], greedy: bool, prefix: str) -> dict[str, float]:
        """Play one episode of each row, score it as a training episode; its records in ``last_played``."""
        plays = self._evaluation_plays(rows, greedy=greedy)
        components: list[dict[str, float]] = [{} for _ in plays]
        returns = self._returns(plays, list(rows), group=1, components=components).tolist()
        self.last_played = [
            episode_record(play, score, parts) for play, score, parts in zip(plays, returns, components, strict=True)
        ]
        metrics = evaluation_metrics(plays, returns if self.rewards is not None else None)
        for name in self.rewards.names if self.rewards is not None else []:
            pairs = zip(components, plays, strict=True)  # an errored episode has no score
            values = [parts.get(name, math.nan) for parts, play in pairs if play.error is None]
            values = [value for value in values if not math.isnan(value)]
            metrics[f"{name}/mean"] = sum(values) / len(values) if values else math.nan
            metrics[f"{name}/solved"] = sum(v >= 1.0 for v in values) / len(values) if values else math.nan
        return {prefix + name: value for name, value in metrics.items()}

    def _evaluation_plays(self, rows: Sequence[dict[str, Any]], greedy: bool) -> list[Play]:
        plays: list[Play] = []
        for start in range(0, len(rows), self.plan.eval_batch_size):
            chunk = self._start(rows[start : start + self.plan.eval_batch_size])
            # step 0 is never a training step: sampled evaluations reuse one stream of draws
            self._play(chunk, step=0, greedy=greedy)
            plays += chunk
        return plays

    # ------------------------------------------------------------------ episodes
    def _built(self) -> Any:
        """A fresh environment; one that reads the policy's tokenizer (``use_tokenizer``: a
        tool-call format taken from its chat template) gets it before ``reset``."""
        env = self.factory()
        if hasattr(env, "use_tokenizer"):
            env.use_tokenizer(self.tokenizer)
        return env

    def _start(self, rows: Sequence[dict[str, Any]]) -> list[Play]:
        """A fresh environment per row, reset with it (``env.max_concurrent`` at a time)."""
        envs = [GuardedEnvironment(self._built(), timeout_s=self.env.timeout_s, name=self.env.name) for _ in rows]
        calls = [lambda env=env, row=row: env.areset(dict(row)) for env, row in zip(envs, rows, strict=True)]
        firsts = self._concurrently(calls, turn=0)
        stop_ids = [self.tokenizer.eos_token_id]
        plays = []
        for env, first in zip(envs, firsts, strict=True):
            if isinstance(first, EpisodeError):
                episode = Episode.start(self.tokenizer, "", self.limits, stop_token_ids=stop_ids)
                plays.append(Play(env, episode, "", error=first))
            else:
                episode = Episode.start(
                    self.tokenizer, first, self.limits, stop_token_ids=stop_ids,
                    on_prefix_mismatch=self.env.on_prefix_mismatch, tools=getattr(env.env, "chat_tools", None),
                    markers=getattr(env.env, "turn_markers", ()),
                )  # fmt: skip
                play = Play(env, episode, first, logprobs=[0.0] * len(episode.ids))
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

    def _play(self, plays: list[Play], step: int, greedy: bool = False, rank: int = 0, round_index: int = 0) -> float:
        """Play every episode to its end, a turn at a time; returns the seconds spent generating."""
        generate_s, turn = 0.0, 0
        while active := [play for play in plays if play.active]:
            turn += 1
            budgets = [play.episode.budget() for play in active]
            # from (seed, step, round, turn, rank): a resumed run plays exactly the same episodes;
            # each episode keeps its own budget's worth of the longest budget's tokens (below)
            seed = sample_seed(self.plan.seed, step, round_index, rank, turn=turn)
            contexts = [play.episode.ids for play in active]
            # a group's episodes start alike: each first context prefilled once, sampled n times
            n = repeat_count(contexts)
            # a turn that more may follow keeps its keys and values: the next prompts begin with them
            more = turn < self.env.max_turns
            sampling = self.plan.params(seed=seed, n=n, max_new_tokens=max(budgets), greedy=greedy, keep_cache=more)
            t0 = time.perf_counter()
            rollouts = self.engine.generate(contexts[::n], sampling)
            generate_s += time.perf_counter() - t0
            lengths = rollouts.response_lengths.tolist()
            turn_versions = rollouts.extras.get("token_versions")
            turn_masks = rollouts.extras.get("sampling_mask")
            stepping = []
            for i, (play, budget) in enumerate(zip(active, budgets, strict=True)):
                # the first tokens of a longer generation are what a shorter one would have sampled
                n = min(lengths[i], budget)
                text = play.episode.add_turn(rollouts.response_ids[i, :n].tolist())
                if turn_masks is not None:  # the turn's tokens follow every token so far
                    play.keep_masks(turn_masks[i, :n], len(play.logprobs))
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
        if (drop_kept := getattr(self.engine, "drop_kept", None)) is not None:  # an engine that keeps turns
            drop_kept()
        return generate_s

    # ------------------------------------------------------------------ the batch
    def _batch(self, plays: list[Play], rows: list[dict[str, Any]], owners: list[int]) -> RolloutBatch:
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
        sample_kept = [kept for play in plays for kept in play.sample_kept]
        if any(sample_kept):
            widest = max(len(ids) for kept in sample_kept for ids in kept.values())
            batch_tensors["sampling_mask"] = torch.full((b, width_t, widest), -1, dtype=torch.int32)
            for i, ((episode, _), kept) in enumerate(zip(samples, sample_kept, strict=True)):
                for position, ids in kept.items():
                    batch_tensors["sampling_mask"][i, position - episode.prompt_length, : len(ids)] = ids
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
        group = self.plan.samples_per_prompt
        names = list(dict.fromkeys(k for row in rows for k in row if k not in RESERVED_COLUMNS))
        return RolloutBatch(
            **batch_tensors,
            group_ids=torch.tensor(owners) // group,
            truncated=torch.tensor([episode.truncated for episode, _ in samples], dtype=torch.bool),
            policy_version=oldest_versions(batch_tensors, self.version),
            prompts=[plays[i].first_observation for i in owners],
            completions=[conversation(plays[i]) for i in owners],
            columns=row_columns(rows, names, owners, group),
        )

    def _scores(self, plays: list[Play], rows: list[dict[str, Any]], owners: list[int], batch: RolloutBatch) -> Tensor:
        """Each episode's return (:meth:`_returns`) on each of its samples, and the ``rewards=``
        functions' components of it as ``batch.reward_components``."""
        return self._returns(plays, rows, self.plan.samples_per_prompt, batch)[owners]

    def _returns(
        self,
        plays: list[Play],
        rows: list[dict[str, Any]],
        group: int,
        batch: RolloutBatch | None = None,
        components: list[dict[str, float]] | None = None,
    ) -> Tensor:
        """Per episode (episode i plays row i // ``group``): its turn rewards plus the ``rewards=``
        score of the conversation (NaN where a function has no score for it); NaN for an episode
        that ended in an error. With ``batch``, the functions' components go on its samples; with
        ``components``, each episode's are filled in by name."""
        # an episode the environment gave no reward (its only turn cut by the budget) returns 0:
        # that is its return, as a single-turn completion cut short is still scored
        returns = torch.tensor([play.total_reward for play in plays], dtype=torch.float32)
        if self.rewards is not None:
            sampled_ids = [
                [t for episode, _ in play.samples for t, m in zip(episode.ids, episode.mask, strict=True) if m]
                for play in plays
            ]
            names = list(dict.fromkeys(k for row in rows for k in row if k not in RESERVED_COLUMNS))
            result = self.rewards.score(
                [play.first_observation for play in plays],
                [conversation(play) for play in plays],
                sampled_ids,
                row_columns(rows, names, range(len(plays)), group),
                group_ids=torch.arange(len(plays)) // group,
                per_turn=True,
            )
            for parts, row in zip(components or [], result.components.tolist(), strict=False):
                parts.update(zip(result.names, row, strict=True))
            if batch is not None:
                batch.reward_components = result.components[[i for i, play in enumerate(plays) for _ in play.samples]]
                self._place_turn_values(plays, result, batch)
            returns = returns + result.scores
        errors = torch.tensor([play.error is not None for play in plays])
        return torch.where(errors, math.nan, returns)

    def _place_turn_values(self, plays: list[Play], result: Any, batch: RolloutBatch) -> None:
        """A reward function's per-turn values (one per assistant turn of an episode), each times
        the function's weight on its turn's last sampled token in ``batch.turn_rewards``, as an
        environment's turn rewards are; the episode's score already holds their weighted sum.
        A list of another length than the episode's turns stops the run naming the function."""
        rows = [(play_index, episode) for play_index, play in enumerate(plays) for episode, _ in play.samples]
        for name, weight, by_episode in zip(result.names, result.weights.tolist(), result.turn_values, strict=True):
            for play_index, values in by_episode.items():
                turns = plays[play_index].turns
                if len(values) != turns:
                    raise RewardFunctionError(
                        f"reward function {name!r} returned {len(values)} per-turn values for an episode of {turns} "
                        "assistant turns: return one value per assistant turn, or one float for the whole episode"
                    )
                for row, (owner, episode) in enumerate(rows):
                    if owner != play_index:
                        continue
                    for j, (_, end) in enumerate(episode.turn_spans):
                        position = end - 1 - episode.prompt_length  # the turn's last sampled token
                        batch.turn_rewards[row, position] += weight * values[episode.turn_offset + j]

    def _check_malformed(self, plays: list[Play], share: float, step: int) -> None:
        """Tool calls the environment could not read (``tools/malformed_fraction``): above
        ``env.max_malformed_fraction`` the run stops with three of them."""
        if share <= self.env.max_malformed_fraction:
            return
        examples = [
            example
            for play in plays
            if play.error is None and callable(getattr(play.env.env, "malformed_examples", None))
            for example in play.env.env.malformed_examples()
        ][:3]
        raise EnvironmentErrors(
            f"step {step}: {100 * share:.0f}% of the policy's turns held a tool call that could not be read, more "
            f"than env.max_malformed_fraction = {self.env.max_malformed_fraction:g}. Check env.options.format "
            "against the model's chat template, or start from a model that writes that format (SFT on recorded "
            "episodes). Three of them:\n  - " + "\n  - ".join(examples)
        )

    def _check_errors(self, plays: list[Play], step: int) -> None:
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


def repeat_count(contexts: Sequence[Sequence[int]]) -> int:
    """k when ``contexts`` is runs of k equal token lists, each run after the last (the episodes
    of a group at their first turn), else 1."""
    k = next((i for i, ids in enumerate(contexts) if ids != contexts[0]), len(contexts))
    if k < 2 or len(contexts) % k:
        return 1
    runs = range(0, len(contexts), k)
    return k if all(contexts[j + i] == contexts[j] for j in runs for i in range(1, k)) else 1
