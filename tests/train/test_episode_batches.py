"""Batches of multi-turn episodes through batch preparation: the environment's tokens between the
policy's turns are context (attended to) but never targets (response_mask 0), and rewards the
source placed on turns reach the estimators where they were placed."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.rollout.batch import RolloutBatch
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_prepare import BatchPreparer, distinct_prompts, sequence_logprobs

VOCAB = 40
BASE = ["model.tiny.layers=1", "data.task=reverse"]
# per episode: its prompt, then the response as (token, sampled?) — turn 1, the environment's
# observation, turn 2; trailing padding where an episode is shorter
EPISODES = [
    ([5, 6, 7], [(11, 1), (12, 1), (30, 0), (31, 0), (13, 1), (2, 1)]),
    ([5, 6, 7], [(14, 1), (32, 0), (33, 0), (34, 0), (15, 1)]),
    ([8, 9], [(16, 1), (17, 1), (2, 1)]),  # a single-turn episode beside them
]


def episode_batch() -> RolloutBatch:
    width_p = max(len(p) for p, _ in EPISODES)
    width_t = max(len(r) for _, r in EPISODES)
    b = len(EPISODES)
    prompt_ids = torch.zeros(b, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(b, width_p, dtype=torch.long)
    response_ids = torch.zeros(b, width_t, dtype=torch.long)
    response_mask = torch.zeros(b, width_t)
    attention = torch.zeros(b, width_t, dtype=torch.long)
    for i, (prompt, response) in enumerate(EPISODES):
        prompt_ids[i, width_p - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, width_p - len(prompt) :] = 1
        response_ids[i, : len(response)] = torch.tensor([t for t, _ in response])
        response_mask[i, : len(response)] = torch.tensor([float(s) for _, s in response])
        attention[i, : len(response)] = 1
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        engine_logprobs=torch.zeros(b, width_t),
        group_ids=torch.tensor([0, 0, 1]),
        truncated=torch.zeros(b, dtype=torch.bool),
        policy_version=torch.zeros(b, dtype=torch.long),
        prompts=["p"] * b,
        completions=["c"] * b,
        columns={},
        response_attention=attention,
    )


def unpadded_logprobs(model, prompt: list[int], response: list[tuple[int, int]]) -> list[float]:
    """Log-prob of each response token given everything before it, one unpadded sequence."""
    ids = torch.tensor([prompt + [t for t, _ in response]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    per_token = logprobs.gather(-1, targets[:, None])[:, 0]
    return per_token[len(prompt) - 1 :].tolist()


@pytest.mark.parametrize("shared_prompt_forward", [False, True])
def test_sampled_tokens_see_the_environment_turns_and_only_they_are_scored(shared_prompt_forward):
    model = build_tiny_causal_lm(VOCAB, layers=2, hidden=32, heads=4, seed=0).eval()
    config = load_rl_config(None, [*BASE, f"shared_prompt_forward={str(shared_prompt_forward).lower()}"])
    batch = episode_batch()
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, batch, config)
    for i, (prompt, response) in enumerate(EPISODES):
        expected = unpadded_logprobs(model, prompt, response)
        for t, (_, sampled) in enumerate(response):
            if sampled:
                assert logprobs[i, t].item() == pytest.approx(expected[t], abs=2e-5), (i, t)
            else:
                assert logprobs[i, t].item() == 0.0  # an environment token is no action of the policy
        assert (logprobs[i, len(response) :] == 0).all()
    # the check can tell: attending only to sampled tokens (the single-turn mask) gives other values
    blind = episode_batch()
    blind.response_attention = None
    with torch.no_grad():
        without_observations, _ = sequence_logprobs(model, blind, config)
    assert (without_observations[0, 4] - logprobs[0, 4]).abs() > 1e-4


def test_samples_of_one_group_with_their_own_prompts_are_each_scored_after_their_own():
    """A group's samples may begin differently: an episode split where the chat template rewrote
    history (``on_prefix_mismatch: new_sample``) goes on as a sample of the same group whose prompt
    is the conversation so far; an environment may draw each episode's first observation. The
    shared prompt forward encodes each distinct prompt once, not each group's first."""
    model = build_tiny_causal_lm(VOCAB, layers=2, hidden=32, heads=4, seed=0).eval()
    config = load_rl_config(None, [*BASE, "shared_prompt_forward=true"])
    batch = episode_batch()
    batch.group_ids = torch.tensor([0, 0, 0])  # the third sample's prompt is not the group's first
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, batch, config)
    prompt, response = EPISODES[2]
    expected = unpadded_logprobs(model, prompt, response)
    assert logprobs[2, : len(response)].tolist() == pytest.approx(expected, abs=2e-5)


def test_a_trimmed_episode_keeps_its_environment_turns():
    batch = episode_batch()
    batch.response_attention[:, -1] = 0  # a padding column no row uses
    batch.response_mask[:, -1] = 0
    trimmed = batch.trimmed()
    assert trimmed.response_ids.shape[1] == 5
    assert trimmed.response_ids[1].tolist() == [14, 32, 33, 34, 15]  # sampled, three observed, sampled


@pytest.mark.parametrize(
    "kl", [["algorithm.kl.placement=none"], ["algorithm.kl.placement=reward", "algorithm.kl.coef=0.1"]]
)
def test_turn_rewards_stay_on_their_turns_and_the_rest_of_the_score_goes_last(kl):
    config = load_rl_config(None, [*BASE, "algorithm=reinforce", *kl])
    batch = episode_batch()
    turn_rewards = torch.zeros(batch.response_ids.shape)
    turn_rewards[0, 1] = -0.1  # the end of episode 0's first turn: a cost per turn
    turn_rewards[0, 5] = 1.0  # resolved on its second turn
    turn_rewards[1, 0] = -0.1
    batch.turn_rewards = turn_rewards
    batch.scores = torch.tensor([0.9 + 0.5, -0.1, 1.0])  # episode 0: 0.5 more from a conversation-level reward
    batch.ref_logprobs = batch.engine_logprobs.clone()  # π_ref = π: the KL term is 0, rewards show bare
    preparer = BatchPreparer(config, None, None, None, _NoKL(), None, [1.0])
    rewards = preparer._token_rewards(batch, {})
    expected = torch.zeros_like(rewards)
    expected[0, 1], expected[0, 5] = -0.1, 1.0 + 0.5
    expected[1, 0], expected[1, 4] = -0.1, 0.0
    expected[2, 2] = 1.0
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(rewards.sum(-1), batch.scores)


class _NoKL:
    value = 0.0

    def update(self, kl: float, n: int) -> None:
        pass


def test_distinct_prompts_are_told_apart_by_tokens_and_mask_in_order_of_first_appearance():
    # rows 0, 2 and 5 hold one prompt; row 3 the same tokens under another mask (a pad that is a
    # real token elsewhere); rows 1 and 4 another prompt each
    ids = torch.tensor([[0, 7, 8], [5, 6, 9], [0, 7, 8], [0, 7, 8], [4, 4, 4], [0, 7, 8]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]])
    first, prompt_of_row = distinct_prompts(ids, mask)
    assert first.tolist() == [0, 1, 3, 4]
    assert prompt_of_row.tolist() == [0, 1, 0, 2, 3, 0]
    assert torch.equal(ids[first][prompt_of_row], ids) and torch.equal(mask[first][prompt_of_row], mask)
