"""Token-in/token-out episodes (issue 19, item 2): sampled tokens kept verbatim with mask 1,
template and observation tokens with mask 0, the ids equal to the template's rendering, the
prefix check catching templates that rewrite history, rewards on each turn's last sampled
token, and the per-turn / per-episode budgets."""

from __future__ import annotations

import pytest

from posttrain.envs.episode import Episode, EpisodeLimits, TemplatePrefixError
from posttrain.models.chat import DEFAULT_CHAT_TEMPLATE, chat_prompt_ids
from posttrain.models.tokenizers import build_char_tokenizer
from tests.envs.chat_fixtures import CHATML, DROPS_NEWLINE, QWEN3_LIKE, chatml_tokenizer, encode

FIRST = [{"role": "user", "content": "my laptop will not turn on"}]
REPLIES = ["ask: battery?", "ask: router?", "fix: charge", "ask: power?"]


@pytest.fixture(scope="module")
def chatml():
    return chatml_tokenizer(CHATML)


class Recorder:
    """A scripted environment: answers each turn with a user message, records what it got."""

    def __init__(self, done_at: int = 99, reward: float | None = 0.5) -> None:
        self.received: list[str] = []
        self.done_at, self.reward = done_at, reward

    def step(self, completion: str):
        self.received.append(completion)
        turn = len(self.received)
        return f"answer {turn}", self.reward, turn >= self.done_at


def sampled(tokenizer, text: str) -> list[int]:
    """What a policy samples for ``text``: its tokens, then the EOS token."""
    return [*encode(tokenizer, text), tokenizer.eos_token_id]


def play(episode: Episode, env: Recorder, replies: list[list[int]]) -> list[list[int]]:
    """Drive the episode with pre-sampled turns; returns the turns actually added."""
    added = []
    for reply in replies:
        if episode.finished:
            break
        text = episode.add_turn(reply)
        added.append(reply)
        if episode.finished:
            break
        episode.add_result(*env.step(text))
    return added


def assert_masks(episode: Episode, turns: list[list[int]]) -> None:
    """Every sampled token is in ids verbatim with mask 1; every other token has mask 0."""
    assert len(episode.ids) == len(episode.mask)
    expected = [0] * len(episode.ids)
    for (start, end), tokens in zip(episode.turn_spans, turns, strict=True):
        assert episode.ids[start:end] == tokens
        expected[start:end] = [1] * (end - start)
    assert episode.mask == expected


def test_chatml_episode_equals_the_template_rendering_every_turn(chatml):
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64))
    env = Recorder()
    assert episode.ids == chat_prompt_ids(chatml, FIRST)
    for turn, reply in enumerate(REPLIES[:3], start=1):
        episode.add_result(*env.step(episode.add_turn(sampled(chatml, reply))))
        # the kept ids are what the template renders for the conversation, generation prompt opened
        assert episode.ids == chat_prompt_ids(chatml, episode.messages), f"turn {turn}"
        # the "\n" the template writes after <|im_end|> follows the sampled <|im_end|>, as a template token
        end = episode.turn_spans[-1][1]
        assert episode.ids[end - 1] == chatml.eos_token_id
        assert episode.ids[end : end + 1] == encode(chatml, "\n")
        assert episode.mask[end] == 0
    assert env.received == REPLIES[:3]
    assert episode.texts == REPLIES[:3]
    assert_masks(episode, [sampled(chatml, r) for r in REPLIES[:3]])
    assert episode.messages[-1] == {"role": "user", "content": "answer 3"}


def test_non_canonical_samples_are_kept_verbatim(chatml):
    # a policy may sample a text as other tokens than the tokenizer would give it: kept as sampled
    text = "ask: battery?"
    by_bytes = [t for char in text for t in encode(chatml, char)] + [chatml.eos_token_id]
    assert by_bytes != sampled(chatml, text)
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64))
    env = Recorder()
    turns = [by_bytes, sampled(chatml, "fix: charge"), by_bytes]
    play(episode, env, turns)
    assert env.received == [text, "fix: charge", text]
    assert_masks(episode, turns)


def test_decoded_turn_skips_special_tokens_as_rl_batches_do(chatml):
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64))
    reply = sampled(chatml, "fix: charge")
    text = episode.add_turn(reply)
    assert text == chatml.decode(reply, skip_special_tokens=True) == "fix: charge"


def test_qwen3_style_template_stripping_earlier_thinking_is_caught():
    tokenizer = chatml_tokenizer(QWEN3_LIKE)
    thinking = "<think>the user says the wifi is down</think>ask: router?"
    episode = Episode.start(tokenizer, FIRST, EpisodeLimits(max_new_tokens=64))
    episode.add_result(*Recorder().step(episode.add_turn(sampled(tokenizer, "ask: battery?"))))  # no thinking: fine
    episode.add_turn(sampled(tokenizer, thinking))
    with pytest.raises(TemplatePrefixError) as caught:
        episode.add_result("yes", None, False)
    error = caught.value
    assert error.turn == 2
    assert "turn 2" in str(error)
    # the earlier rendering has the sampled <think>, the later one jumps to the visible answer
    assert tokenizer.decode([error.expected]) == tokenizer.decode(encode(tokenizer, "<think>")[:1])
    assert tokenizer.decode([error.got]) == tokenizer.decode(encode(tokenizer, "ask")[:1])
    assert f"token {error.position}" in str(error)
    assert repr(tokenizer.decode(encode(tokenizer, "<think>")[:1])).strip("'") in str(error)


def test_template_dropping_the_newline_after_end_of_turn_is_caught():
    tokenizer = chatml_tokenizer(DROPS_NEWLINE)
    episode = Episode.start(tokenizer, FIRST, EpisodeLimits(max_new_tokens=64))
    episode.add_turn(sampled(tokenizer, "ask: battery?"))
    with pytest.raises(TemplatePrefixError) as caught:
        episode.add_result("yes", None, False)
    error = caught.value
    assert error.turn == 1
    assert error.expected == encode(tokenizer, "\n")[0]
    assert error.got == tokenizer.convert_tokens_to_ids("<|im_start|>")
    # the first difference is right after the first user message's <|im_end|>
    assert error.position == encode(tokenizer, "\n").__len__() + chat_prompt_ids(tokenizer, FIRST).index(
        tokenizer.eos_token_id
    )


def test_prefix_mismatch_can_continue_as_a_new_sample():
    tokenizer = chatml_tokenizer(QWEN3_LIKE)
    thinking = "<think>the user says the wifi is down</think>ask: router?"
    limits = EpisodeLimits(max_new_tokens=64, max_turns=4)
    episode = Episode.start(tokenizer, FIRST, limits, on_prefix_mismatch="new_sample")
    episode.add_turn(sampled(tokenizer, thinking))
    episode.add_result("yes", 0.25, False)
    assert episode.continues_as_new_sample and not episode.truncated
    assert episode.rewards == [(episode.turn_spans[0][1] - 1, 0.25)]  # the turn's reward stays with its sample
    assert episode.mask[-1] == 1  # this sample ends with the policy's turn
    follow = episode.next_sample()
    # the new sample's prompt is the template's rendering of the conversation, thinking stripped
    assert follow.ids == chat_prompt_ids(tokenizer, episode.messages)
    assert tokenizer.decode(follow.ids).count("<think>") == 0
    assert set(follow.mask) == {0}
    follow.add_turn(sampled(tokenizer, "fix: reboot"))
    assert follow.turn == 2 and follow.stop_token_ids == episode.stop_token_ids
    follow.add_result(None, 1.0, True)
    assert follow.stop_reason == "done"


def test_char_tokenizer_keeps_its_eos_and_the_template_closes_the_turn():
    # posttrain's default template ends a turn with <|end|>\n, which the char tokenizer spells in
    # characters; its <eos> is not in the template: kept as sampled, the template's end follows
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    episode = Episode.start(tokenizer, FIRST, EpisodeLimits(max_new_tokens=32))
    env = Recorder()
    turns = [sampled(tokenizer, "ask: battery?"), sampled(tokenizer, "fix: charge")]
    play(episode, env, turns)
    assert env.received == ["ask: battery?", "fix: charge"]
    assert_masks(episode, turns)
    without_eos = [t for t in episode.ids if t != tokenizer.eos_token_id]
    assert without_eos == chat_prompt_ids(tokenizer, episode.messages)
    end = episode.turn_spans[0][1]
    assert tokenizer.decode(episode.ids[end : end + 8]) == "<|end|>\n"


# A template for character-level models whose assistant turns end with the EOS token itself:
# the sampled EOS is then the template's end of turn, and RL contexts equal SFT's renderings.
EOS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_char_tokenizer_with_eos_as_end_of_turn_equals_the_rendering():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = EOS_TEMPLATE
    episode = Episode.start(tokenizer, FIRST, EpisodeLimits(max_new_tokens=32))
    turns = [sampled(tokenizer, "ask: battery?"), sampled(tokenizer, "fix: charge")]
    play(episode, Recorder(), turns)
    assert episode.ids == chat_prompt_ids(tokenizer, episode.messages)
    assert_masks(episode, turns)


def test_stop_tokens_other_than_eos(chatml):
    turn = encode(chatml, "ask: battery?")
    stop = turn[-1]  # say the engine stops at the token that ends a question
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=len(turn)), stop_token_ids=[stop])
    episode.add_turn(turn)  # fills the budget, but ends in a stop token: not cut
    assert not episode.finished
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=len(turn)))
    episode.add_turn(turn)
    assert episode.cut_turns == [1] and not episode.finished


def test_text_episode_appends_observations_as_their_tokens(chatml):
    episode = Episode.start(chatml, "what is 2*(3+4)? ", EpisodeLimits(max_new_tokens=32))
    reply = encode(chatml, "<calc>2*(3+4)</calc>")  # stopped by a stop string, no EOS
    episode.add_turn(reply)
    episode.add_result(" <result>14</result> ", None, False)
    assert episode.ids == [*encode(chatml, "what is 2*(3+4)? "), *reply, *encode(chatml, " <result>14</result> ")]
    assert_masks(episode, [reply])


def test_reward_on_each_turns_last_sampled_token_with_per_turn_discount(chatml):
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64, discount=0.5))
    env = Recorder(done_at=3, reward=2.0)
    play(episode, env, [sampled(chatml, r) for r in REPLIES[:3]])
    assert episode.stop_reason == "done" and not episode.truncated
    lasts = [end - 1 for _, end in episode.turn_spans]
    assert episode.rewards == [(lasts[0], 2.0), (lasts[1], 1.0), (lasts[2], 0.5)]
    token_rewards = episode.token_rewards()
    assert [token_rewards[i] for i in lasts] == [2.0, 1.0, 0.5]
    assert sum(token_rewards) == 3.5
    assert all(episode.mask[i] == 1 for i in lasts)


def test_a_turn_without_reward_places_none(chatml):
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64))
    play(episode, Recorder(reward=None), [sampled(chatml, "ask: battery?")])
    assert episode.rewards == [] and set(episode.token_rewards()) == {0.0}


def test_a_turn_cut_by_max_new_tokens_is_answered_and_flagged(chatml):
    """A policy that never finishes a turn must not escape the environment's costs: the cut turn
    is the policy's message, answered like any other, and the episode is flagged truncated."""
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=4))
    assert episode.budget() == 4
    cut = encode(chatml, "ask: battery? ask: battery?")[:4]  # no EOS: cut by the budget
    text = episode.add_turn(cut)
    assert not episode.finished and episode.truncated and episode.cut_turns == [1]
    episode.add_result([{"role": "user", "content": "sorry?"}], -0.1, False)
    assert episode.rewards == [(episode.turn_spans[0][1] - 1, -0.1)]
    assert episode.ids == chat_prompt_ids(chatml, [*FIRST, {"role": "assistant", "content": text},
                                                   {"role": "user", "content": "sorry?"}])  # fmt: skip
    assert_masks(episode, [cut])
    with pytest.raises(ValueError, match="budget"):
        Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=4)).add_turn(encode(chatml, "ask: battery?") * 2)


def test_episode_budget_shrinks_the_turns_and_truncates(chatml):
    prompt = len(chat_prompt_ids(chatml, FIRST))
    reply = sampled(chatml, "ask: battery?")
    after_answer = [*FIRST, {"role": "assistant", "content": "ask: battery?"}, {"role": "user", "content": "answer 1"}]
    limits = EpisodeLimits(max_new_tokens=64, max_total_tokens=len(chat_prompt_ids(chatml, after_answer)) + 5)
    episode = Episode.start(chatml, FIRST, limits)
    assert episode.budget() == min(64, limits.max_total_tokens - prompt)
    episode.add_result(*Recorder().step(episode.add_turn(reply)))
    # the observation fitted, leaving 5 tokens of the episode's budget for the next turn
    assert not episode.finished and episode.budget() == 5
    episode.add_turn(encode(chatml, "fix: charge fix: charge fix: charge")[:5])
    assert episode.stop_reason == "max_total_tokens" and episode.truncated
    assert len(episode.ids) == limits.max_total_tokens


def test_observation_that_does_not_fit_ends_the_episode_truncated(chatml):
    prompt = len(chat_prompt_ids(chatml, FIRST))
    reply = sampled(chatml, "ask: battery?")
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64, max_total_tokens=prompt + len(reply) + 3))
    episode.add_turn(reply)
    episode.add_result("a long answer that cannot fit in three tokens", 1.0, False)
    assert episode.stop_reason == "max_total_tokens" and episode.truncated
    assert len(episode.ids) == prompt + len(reply)  # nothing of the observation was appended
    assert episode.rewards == [(len(episode.ids) - 1, 1.0)]


def test_max_turns_ends_the_episode_truncated(chatml):
    episode = Episode.start(chatml, FIRST, EpisodeLimits(max_new_tokens=64, max_turns=2))
    env = Recorder()
    turns = play(episode, env, [sampled(chatml, r) for r in REPLIES])
    assert len(turns) == 2 and len(env.received) == 2
    assert episode.stop_reason == "max_turns" and episode.truncated
    assert episode.mask[-1] == 1  # nothing is appended after the last turn


# Llama 3's templates write each message's content trimmed: a turn sampled with a leading space is
# written without it, and mistral-common's encoder writes a call held as text otherwise than sampled
TRIMS = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")


def test_a_template_that_writes_the_turn_its_own_way_appends_what_follows_its_end_of_turn():
    tokenizer = chatml_tokenizer(TRIMS)
    episode = Episode.start(tokenizer, FIRST, EpisodeLimits(max_new_tokens=64))
    turn = sampled(tokenizer, " ask: battery? ")
    episode.add_turn(turn)
    episode.add_result("yes", None, False)  # a TemplatePrefixError before ("its text changed")
    assert episode.rewritten_turns == [1]
    after = encode(tokenizer, "\n<|im_start|>user\nyes<|im_end|>\n<|im_start|>assistant\n")
    assert episode.ids == [*chat_prompt_ids(tokenizer, FIRST), *turn, *after]
    assert episode.mask == [0] * len(chat_prompt_ids(tokenizer, FIRST)) + [1] * len(turn) + [0] * len(after)
    episode.add_turn(sampled(tokenizer, "fix: charge"))  # written as sampled: the template's own tokens
    episode.add_result("thanks", None, False)
    assert episode.rewritten_turns == [1]
    # history is still checked: the conversation before the turn must stay as the turn saw it
    qwen = chatml_tokenizer(QWEN3_LIKE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}"))
    episode = Episode.start(qwen, FIRST, EpisodeLimits(max_new_tokens=64))
    episode.add_turn(sampled(qwen, "<think>hm</think> ask: battery? "))
    with pytest.raises(TemplatePrefixError, match="adding the observation rewrites the conversation before it"):
        episode.add_result("yes", None, False)  # the user's answer drops the turn's thinking


def test_a_cut_turn_the_template_writes_its_own_way_gets_the_templates_end_of_turn():
    tokenizer = chatml_tokenizer(TRIMS)
    episode = Episode.start(tokenizer, FIRST, EpisodeLimits(max_new_tokens=4))
    turn = encode(tokenizer, " ask: battery? ")[:4]  # cut by max_new_tokens before its stop token
    episode.add_turn(turn)
    episode.add_result("yes", None, False)
    after = encode(tokenizer, "\n<|im_start|>user\nyes<|im_end|>\n<|im_start|>assistant\n")
    assert episode.ids[len(chat_prompt_ids(tokenizer, FIRST)) :] == [*turn, tokenizer.eos_token_id, *after]
