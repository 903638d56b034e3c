"""Token-in/token-out assembly of one multi-turn episode (docs/design.md, "Next").

The episode's token ids grow turn by turn and are never tokenised again: the tokens the
policy sampled are appended verbatim (mask 1), then the tokens the chat template writes
after them — the rest of the assistant's end of turn (ChatML's ``\\n`` after ``<|im_end|>``),
the environment's observation as a user or tool turn, and the opening of the next
assistant turn — are appended with mask 0. Those template tokens are cut out of the
template's own renderings, so with canonically tokenised samples the ids equal what the
template renders for the whole conversation.

That only works when each rendering extends the previous one. Chat templates that rewrite
history break it (Qwen3's drops the ``<think>`` block of earlier assistant turns; some lose
the newline after the end-of-turn token at turn boundaries): the policy would be trained on
a context it never saw. So every turn checks, in tokens, that

1. the conversation through the policy's turn k extends the prompt the policy continued
   (the template writes an assistant turn the way its generation prompt opens it);
2. that rendering holds the sampled text unchanged before the template's end of turn;
3. the conversation with the turn-k observation extends the conversation through turn k.

A failure raises :class:`TemplatePrefixError` naming the turn and the first differing
tokens, or, with ``on_prefix_mismatch="new_sample"``, ends this sample at the policy's turn
and marks that the episode goes on as a new sample (:meth:`Episode.next_sample`).

Plain-text episodes (the first observation a string) have no template: observations are
appended as their own tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.envs.base import Observation
from posttrain.envs.turn_text import decode_turn, encode_turn, kept_markers
from posttrain.errors import PosttrainError
from posttrain.models.chat import ChatTemplateError, chat_prompt_ids


class TemplatePrefixError(PosttrainError, ValueError):
    """The chat template rewrites an earlier part of the conversation at ``turn``; the message
    gives the first differing token (``position``, ``expected`` from the earlier rendering,
    ``got`` from the later one; -1 where a rendering ended)."""

    def __init__(self, message: str, *, turn: int, position: int, expected: int, got: int) -> None:
        super().__init__(message)
        self.turn, self.position, self.expected, self.got = turn, position, expected, got


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_new_tokens`` per turn, ``max_total_tokens`` for the whole sequence (prompt
    included; None: no limit), ``max_turns`` policy turns; ``discount`` γ per turn: turn k's
    reward is placed as γ^(k-1)·r_k, so the sum over the episode is the return discounted by
    turns (the estimators' own γ counts tokens, and turns differ in length)."""

    max_new_tokens: int
    max_total_tokens: int | None = None
    max_turns: int = 8
    discount: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.max_turns < 1:
            raise ValueError(f"max_new_tokens and max_turns must be >= 1, got {self.max_new_tokens}, {self.max_turns}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {self.discount}")


StopReason = Literal["done", "max_turns", "max_total_tokens", "new_sample"]


@dataclass
class Episode:
    """State of one episode (or of one sample of it, see :meth:`next_sample`).

    ``ids``/``mask``: every token so far, mask 1 where the policy sampled it. ``turn_spans``:
    ``(start, end)`` of each sampled turn in ``ids``; ``texts``: each turn decoded as the
    environment received it; ``rewards``: ``(position, reward)`` with position the turn's last
    sampled token. ``messages``: the conversation as chat messages (for ``rewards=`` functions
    and for continuing as a new sample). ``stop_reason``/``truncated`` once ``finished``.

    Build with :meth:`start`; then per turn: ``budget()`` tokens may be sampled from ``ids``,
    ``add_turn(sampled)`` returns the text for ``env.step``, ``add_result(...)`` appends what the
    environment answered."""

    tokenizer: Any
    limits: EpisodeLimits
    on_prefix_mismatch: Literal["error", "new_sample"] = "error"
    chat: bool = True
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    turn_offset: int = 0
    """Turns taken by earlier samples of the same episode (turn numbers continue)."""
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end a turn (the engine's stop tokens); empty: the tokenizer's EOS."""
    stop_reason: StopReason | None = None
    cut_turns: list[int] = field(default_factory=list)
    rewritten_turns: list[int] = field(default_factory=list)
    """Turns the template writes otherwise than sampled: their observation is its delta (``_delta``)."""
    """Turns cut by ``max_new_tokens`` before their stop token (the environment still answers them)."""
    tools: list[dict[str, Any]] | None = None
    """The environment's ``chat_tools``: JSON schemas every rendering gives the chat template."""
    markers: dict[int, str] = field(default_factory=dict)
    """Special tokens a turn's text keeps, by id: the tool-call format's markers (``turn_text.py``)."""
    _rendered: list[int] = field(default_factory=list)  # the template's ids of the conversation so far
    _awaiting_result: bool = False  # a turn was added and the environment's answer not yet

    @classmethod
    def start(
        cls,
        tokenizer: Any,
        first_observation: Observation,
        limits: EpisodeLimits,
        *,
        on_prefix_mismatch: Literal["error", "new_sample"] = "error",
        turn_offset: int = 0,
        stop_token_ids: Sequence[int] = (),
        tools: Sequence[dict[str, Any]] | None = None,
        markers: Sequence[str] = (),
    ) -> Episode:
        """An episode from the environment's first observation: text is tokenised as is,
        messages through the chat template with the assistant's turn opened.
        ``stop_token_ids``: the tokens the engine stops a turn at (default: EOS); a turn that
        fills its budget without ending in one was cut. ``markers``: the environment's
        ``turn_markers`` (its tool-call format's), kept in each turn's text where they are special
        tokens (``turn_text.py``)."""
        if on_prefix_mismatch not in ("error", "new_sample"):
            raise ValueError(f"on_prefix_mismatch must be 'error' or 'new_sample', got {on_prefix_mismatch!r}")
        episode = cls(tokenizer, limits, on_prefix_mismatch, chat=not isinstance(first_observation, str))
        episode.turn_offset, episode.tools = turn_offset, list(tools) if tools else None
        episode.stop_token_ids = frozenset(stop_token_ids or [tokenizer.eos_token_id])
        episode.markers = kept_markers(tokenizer, markers)
        if episode.chat:
            episode.messages = [dict(m) for m in first_observation]
            episode._rendered = chat_prompt_ids(tokenizer, episode.messages, tools=episode.tools)
            ids = list(episode._rendered)
        else:
            episode.messages = [{"role": "user", "content": first_observation}]
            ids = encode_text(tokenizer, first_observation)
        episode._append(ids, 0)
        if episode.budget() < 1:
            episode.stop_reason = "max_total_tokens"
        return episode

    # --------------------------------------------------------------------------- state

    @property
    def turn(self) -> int:
        """Number of the last policy turn, counted over the whole episode (1-based)."""
        return self.turn_offset + len(self.texts)

    @property
    def prompt_length(self) -> int:
        return self.turn_spans[0][0] if self.turn_spans else len(self.ids)

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    @property
    def truncated(self) -> bool:
        """A limit cut something: a turn (``max_new_tokens``) or the episode (``max_turns``,
        ``max_total_tokens``), rather than the environment ending it."""
        return self.stop_reason in ("max_turns", "max_total_tokens") or bool(self.cut_turns)

    @property
    def continues_as_new_sample(self) -> bool:
        return self.stop_reason == "new_sample"

    def budget(self) -> int:
        """Tokens the policy may sample in its next turn: the per-turn limit, or what is left
        of the episode's."""
        room = self.limits.max_new_tokens
        if self.limits.max_total_tokens is not None:
            room = min(room, self.limits.max_total_tokens - len(self.ids))
        return max(room, 0)

    # --------------------------------------------------------------------------- turns

    def add_turn(self, sampled_ids: Sequence[int]) -> str:
        """Append the policy's sampled tokens verbatim (mask 1) and return their decoded text,
        special tokens skipped as everywhere in posttrain but for the tool-call format's
        ``markers``: what ``env.step`` receives and the stored assistant message holds (so the
        template writes the turn back as sampled).

        A turn cut by ``max_new_tokens`` before its stop token is still the policy's message: the
        environment answers it (and charges for it, as a user would) and the turn is flagged
        (``cut_turns``). Ending the episode there instead would give a policy that never
        finishes a turn an episode with no costs, which RL then learns to prefer. A turn cut by
        what is left of ``max_total_tokens`` ends the episode: there is no room to go on."""
        if self.finished:
            raise RuntimeError(f"episode finished ({self.stop_reason}); no more turns")
        sampled = [int(t) for t in sampled_ids]
        budget = self.budget()
        if not sampled or len(sampled) > budget:
            raise ValueError(f"turn {self.turn + 1}: {len(sampled)} sampled tokens, the budget is 1 to {budget}")
        start = len(self.ids)
        self._append(sampled, 1)
        self.turn_spans.append((start, len(self.ids)))
        text = decode_turn(self.tokenizer, sampled, self.markers)
        self.texts.append(text)
        self.messages.append({"role": "assistant", "content": text})
        self._awaiting_result = True
        if sampled[-1] not in self.stop_token_ids and len(sampled) == budget:
            if budget < self.limits.max_new_tokens:
                self.stop_reason = "max_total_tokens"
            else:
                self.cut_turns.append(self.turn)
        return text

    def add_result(self, observation: Observation | None, reward: float | None, done: bool) -> None:
        """What ``env.step`` returned for the last turn: its reward goes on that turn's last
        sampled token (times γ^(k-1)); unless the episode ends, the observation and the
        template's tokens around it are appended with mask 0."""
        if self.finished:
            raise RuntimeError(f"episode finished ({self.stop_reason}); the environment is not stepped any more")
        if not self._awaiting_result:
            raise RuntimeError("add_result needs a turn (add_turn) first")
        self._awaiting_result = False
        if reward is not None:
            discount = self.limits.discount ** (self.turn - 1)
            self.rewards.append((self.turn_spans[-1][1] - 1, discount * float(reward)))
        if done:
            self.stop_reason = "done"
            return
        if observation is None:
            raise ValueError(f"turn {self.turn}: no observation to continue from (done=False)")
        if self.turn >= self.limits.max_turns:
            self.stop_reason = "max_turns"
            return
        new_messages = _as_messages(observation) if self.chat else None
        if self.chat:
            tail = self._chat_tail(new_messages)
            if tail is None:
                self.messages.extend(new_messages)
                self.stop_reason = "new_sample"
                return
        else:
            if not isinstance(observation, str):
                raise ValueError(f"turn {self.turn}: a text episode needs text observations, got chat messages")
            tail = encode_text(self.tokenizer, observation)
        self.messages.extend(new_messages or [{"role": "user", "content": observation}])
        limit = self.limits.max_total_tokens
        if limit is not None and len(self.ids) + len(tail) >= limit:
            # no room left to sample after the observation: the episode is cut here
            self.stop_reason = "max_total_tokens"
            return
        self._append(tail, 0)

    def next_sample(self) -> Episode:
        """After a prefix mismatch with ``on_prefix_mismatch="new_sample"``: the episode goes
        on as a new sample whose prompt is the template's rendering of the whole conversation
        so far; turn numbers (and so ``max_turns`` and the discount) continue, while
        ``max_total_tokens`` applies to each sample's own sequence."""
        if not self.continues_as_new_sample:
            raise RuntimeError(f"this sample does not continue as a new one (stop reason: {self.stop_reason})")
        return Episode.start(
            self.tokenizer,
            self.messages,
            self.limits,
            on_prefix_mismatch=self.on_prefix_mismatch,
            turn_offset=self.turn,
            stop_token_ids=sorted(self.stop_token_ids),
            tools=self.tools,
            markers=list(self.markers.values()),
        )

    @property
    def total_reward(self) -> float:
        """The sum of the turn rewards placed so far (discounted as placed): the episode's return."""
        return sum(reward for _, reward in self.rewards)

    def token_rewards(self) -> list[float]:
        """One reward per token of ``ids``: each turn's reward on its last sampled token, 0 elsewhere."""
        rewards = [0.0] * len(self.ids)
        for position, reward in self.rewards:
            rewards[position] += reward
        return rewards

    # --------------------------------------------------------------------------- internals

    def _append(self, ids: Sequence[int], mask: int) -> None:
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))

    def _chat_tail(self, observation: list[dict[str, Any]]) -> list[int] | None:
        """Template tokens to append after the last sampled turn (rest of its end of turn,
        the observation, the next generation prompt); None when the template rewrites the
        conversation before the turn and the episode continues as a new sample.

        The conversation with the observation must extend the prompt the turn was sampled from.
        Then the template's rendering through the turn is checked to write the turn as sampled,
        and what follows it is appended. A template that writes the turn its own way (Llama 3's
        trims it; mistral-common's encoder writes a call as text, or cannot render a conversation
        ending in the assistant's turn at all) gets :meth:`_delta` instead: what the template
        writes after its own end of that turn. Its turns are listed in ``rewritten_turns``."""
        turn, text = self.turn, self.texts[-1]
        start, end = self.turn_spans[-1]
        sampled = self.ids[start:end]
        with_observation = chat_prompt_ids(self.tokenizer, [*self.messages, *observation], tools=self.tools)
        position = _first_difference(self._rendered, with_observation)
        if position is not None:
            if self.on_prefix_mismatch == "new_sample":
                return None
            what = "adding the policy's turn and the observation rewrites the conversation before the turn"
            raise self._mismatch(turn, what, self._rendered, with_observation, position)
        try:
            with_reply = chat_prompt_ids(self.tokenizer, self.messages, add_generation_prompt=False, tools=self.tools)
        except (ChatTemplateError, ValueError):  # mistral-common's: the last message may not be the assistant's
            with_reply = None
        content = encode_text(self.tokenizer, text)
        written = with_reply is not None and _first_difference([*self._rendered, *content], with_reply) is None
        # the template's own rendering through the turn, when it has one: the observation must not change it
        through_turn = with_reply if written else self._template_turn(with_reply)
        position = None if through_turn is None else _first_difference(through_turn, with_observation)
        if position is not None:
            if self.on_prefix_mismatch == "new_sample":
                return None
            what = "adding the observation rewrites the conversation before it"
            raise self._mismatch(turn, what, through_turn, with_observation, position)
        if not written:
            self.rewritten_turns.append(turn)
            tail = self._delta(turn, sampled, with_observation)
        else:
            end_of_turn = with_reply[len(self._rendered) + len(content) :]
            stops = _trailing_special(sampled, set(self.tokenizer.all_special_ids))
            # the sampled stop token (ChatML's <|im_end|>) is the template's end of turn: append
            # only what the template writes after it (the "\n"); a stop token the template does
            # not write (a bare <eos>) stays as sampled, and the template's end of turn follows it
            if stops and end_of_turn[: len(stops)] == stops:
                end_of_turn = end_of_turn[len(stops) :]
            tail = [*end_of_turn, *with_observation[len(with_reply) :]]
        self._rendered = with_observation
        return tail

    def _template_turn(self, with_reply: list[int] | None) -> list[int] | None:
        """The template's rendering through its own version of the last turn, up to and with the
        turn's first stop token; None when it cannot render the turn or ends it with none."""
        if with_reply is None:
            return None
        ends = [i for i in range(len(self._rendered), len(with_reply)) if with_reply[i] in self.stop_token_ids]
        return with_reply[: ends[0] + 1] if ends else None

    def _delta(self, turn: int, sampled: list[int], with_observation: list[int]) -> list[int]:
        """What the template writes after its own version of the policy's turn: from the first
        stop token in its rendering of the turn and the observation (mistral-common's ``</s>``,
        ChatML's ``<|im_end|>``) on; past it when the sampled turn ended in that token, from it
        when the turn was cut before its stop."""
        written = with_observation[len(self._rendered) :]
        ends = [i for i, token in enumerate(written) if token in self.stop_token_ids]
        if not ends:
            raise self._mismatch(
                turn,
                "the template writes the policy's turn otherwise than sampled and ends it with none of the stop tokens "
                f"{sorted(self.stop_token_ids)}, so the observation cannot be placed after it",
                [*self._rendered, *sampled],
                with_observation,
                len(self._rendered),
            )
        stopped = bool(sampled) and sampled[-1] == written[ends[0]]
        return written[ends[0] + stopped :]

    def _mismatch(
        self, turn: int, what: str, before: list[int], after: list[int], position: int
    ) -> TemplatePrefixError:
        expected = before[position] if position < len(before) else -1
        got = after[position] if position < len(after) else -1

        def show(ids: list[int]) -> str:
            return repr(self.tokenizer.decode(ids[position : position + 8], skip_special_tokens=False))

        return TemplatePrefixError(
            f"chat template rewrites history at turn {turn}: {what}. First difference at token {position}: "
            f"expected {expected} {show(before)}, got {got} {show(after)} (decoded from there on; -1: the rendering "
            "ends). The policy would be trained on a context it never saw: fix the chat template (keep earlier turns "
            "as written), or set on_prefix_mismatch='new_sample' to continue the episode as a new sample",
            turn=turn,
            position=position,
            expected=expected,
            got=got,
        )


def replay_actions(
    tokenizer: Any,
    env: Any,
    row: dict[str, Any],
    actions: Sequence[str],
    limits: EpisodeLimits,
) -> Episode:
    """The episode a policy that wrote ``actions`` (each then EOS) would have played against
    ``env``: the same token ids and masks the rollout source builds, so ``(episode.ids,
    episode.mask)`` is a supervised example training every policy turn on exactly the context
    RL continues (a cold start for multi-turn RL). ``env`` must end the episode or answer each
    action; its own rewards are kept in ``episode.rewards``."""
    from posttrain.envs.base import GuardedEnvironment

    guarded = GuardedEnvironment(env, timeout_s=None)
    if hasattr(env, "use_tokenizer"):
        env.use_tokenizer(tokenizer)
    first = guarded.reset(dict(row))
    tools, markers = getattr(env, "chat_tools", None), getattr(env, "turn_markers", ())
    episode = Episode.start(tokenizer, first, limits, tools=tools, markers=markers)
    for action in actions:
        if episode.finished:
            raise ValueError(f"the episode ended ({episode.stop_reason}) before action {action!r}")
        episode.add_turn([*encode_turn(tokenizer, action, episode.markers), tokenizer.eos_token_id])
        if episode.finished:
            break
        result = guarded.step(episode.texts[-1])
        episode.add_result(result.observation, result.reward, result.done)
    return episode


def _first_difference(prefix: Sequence[int], ids: Sequence[int]) -> int | None:
    """None when ``ids`` starts with ``prefix``, else the first position where they differ."""
    if len(prefix) <= len(ids) and list(ids[: len(prefix)]) == list(prefix):  # compared in C, the usual case
        return None
    for position, token in enumerate(prefix):
        if position >= len(ids) or ids[position] != token:
            return position
    return None


def _trailing_special(ids: Sequence[int], special: set[int]) -> list[int]:
    count = 0
    while count < len(ids) and ids[len(ids) - 1 - count] in special:
        count += 1
    return list(ids[len(ids) - count :])


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids as the tokenizer writes them inside a turn (no BOS or other added tokens)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_messages(observation: Observation) -> list[dict[str, Any]]:
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not all(isinstance(m, Mapping) for m in observation):
        raise ValueError(f"an observation must be text or chat messages, got {observation!r:.80}")
    return [dict(m) for m in observation]
