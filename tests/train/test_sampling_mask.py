"""One behaviour log-prob under truncated sampling, and the trainer's log-probs over the same kept
set (``rollout.keep_sampling_mask``): with top-p 0.9 the engine reports the log-prob of the
distribution it sampled from (renormalised over the kept tokens); the trainer's forward of the
same weights matches it exactly when it renormalises over the recorded kept sets, and is off by
the log of the kept mass when it does not."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.rollout.batch import concat
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_prepare import sequence_logprobs
from tests.train.matrix_features import ENV, write_rows
from tests.train.test_rl import SMALL, TINY, vowel_share

TRUNCATED = ["sampling.top_p=0.9", "sampling.temperature=1.2", "max_new_tokens=8"]
PASSES = {  # the three ways the trainer computes log-probs (train/rl_prepare.py)
    "padded": ["shared_prompt_forward=false", "padding_free=false"],
    "shared_prompt": ["shared_prompt_forward=true", "padding_free=false"],
    "padding_free": ["padding_free=true"],
}


def first_batch(tmp_path, overrides, rewards=(vowel_share,), data=SMALL):
    config = load_rl_config(None, [*TINY, *data, *TRUNCATED, f"output_dir={tmp_path / 'run'}", *overrides])
    run = OnlineRL(config, reward_functions=list(rewards), echo=lambda line: None)
    batch, _ = run.source.next_batch(1)
    return run, batch


def ratios(run, batch):
    """exp(trainer − engine) on every sampled token: the first minibatch's importance ratios."""
    with torch.no_grad():
        trainer, _ = sequence_logprobs(run.policy, batch, run.config)
    sampled = batch.response_mask.bool()
    return torch.exp(trainer - batch.engine_logprobs)[sampled]


@pytest.mark.parametrize("passes", PASSES, ids=list(PASSES))
def test_ratios_start_at_one_over_the_kept_sets_and_not_without(tmp_path, passes):
    run, batch = first_batch(tmp_path, [*PASSES[passes], "rollout.keep_sampling_mask=true"])
    mask = batch.sampling_mask
    assert mask is not None and mask.shape[:2] == batch.response_ids.shape
    kept = (mask >= 0).sum(-1)[batch.response_mask.bool()]
    assert kept.min() >= 1 and kept.float().mean() < 0.9 * len(run.tokenizer)  # top-p dropped tokens
    # every sampled token lies in its own kept set
    assert ((mask == batch.response_ids[..., None]).any(-1) | (batch.response_mask == 0)).all()
    with_mask = ratios(run, batch)
    torch.testing.assert_close(with_mask, torch.ones_like(with_mask), rtol=0, atol=1e-5)
    run.config.rollout.keep_sampling_mask = False  # the same batch, the trainer over the whole vocabulary
    without = ratios(run, batch)
    assert (without - 1).abs().max() > 0.05 and (without <= 1 + 1e-6).all()  # π(a) ≤ π(a)/π(K)
    run.source.close()


def test_multi_turn_episodes_keep_each_turns_sets(tmp_path):
    data = [f"data.path={write_rows(tmp_path / 'rows.jsonl')}", "prompts_per_step=4", "samples_per_prompt=2"]
    env = [f"env.name={ENV}", "env.max_turns=3", "rewards=[]", "allow_constant_reward=[]", "reward_workers=0"]
    run, batch = first_batch(tmp_path, [*env, "rollout.keep_sampling_mask=true"], rewards=(), data=data)
    sampled = batch.response_mask.bool()
    assert batch.sampling_mask is not None and (batch.response_attention.bool() & ~sampled).any()  # turns between
    # sets on the policy's tokens only; the environment's tokens have none
    has_set = batch.sampling_mask[..., 0] >= 0
    assert (has_set == sampled).all()
    with_mask = ratios(run, batch)
    torch.testing.assert_close(with_mask, torch.ones_like(with_mask), rtol=0, atol=1e-5)
    run.source.close()


def test_one_update_logs_no_engine_gap_with_the_mask(tmp_path):
    gaps = {}
    for keep in (True, False):
        config = load_rl_config(
            None,
            [*TINY, *SMALL, *TRUNCATED, "steps=1", f"output_dir={tmp_path / str(keep)}",
             f"rollout.keep_sampling_mask={str(keep).lower()}"],
        )  # fmt: skip
        history = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None).run()
        gaps[keep] = history[0]["policy/engine_logprob_gap"]
    assert gaps[True] < 1e-5 < 1e-2 < gaps[False]


def test_batches_with_kept_sets_of_different_sizes_concatenate(tmp_path):
    run, batch = first_batch(tmp_path, ["rollout.keep_sampling_mask=true"])
    narrow = batch.select([0, 1])
    narrow.sampling_mask = narrow.sampling_mask[..., :3].clone()
    merged = concat([narrow, batch.select([2])], pad_id=0)
    assert merged.sampling_mask.shape[2] == batch.sampling_mask.shape[2]
    assert (merged.sampling_mask[:2, :, 3:] == -1).all()
    assert torch.equal(merged.sampling_mask[2:, : batch.response_ids.shape[1]], batch.sampling_mask[2:3])
    trimmed = batch.trimmed()
    assert trimmed.sampling_mask.shape[:2] == trimmed.response_ids.shape
    run.source.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "sampling keeps every token"),
        (["sampling.top_p=0.9", "rollout.engine=vllm"], "not supported yet"),
    ],
)
def test_a_mask_that_cannot_mean_anything_is_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_rl_config(None, [*TINY, *SMALL, "rollout.keep_sampling_mask=true", *overrides])


def test_replaying_a_recording_without_kept_sets_under_keep_sampling_mask_is_refused(tmp_path, capsys):
    """Hardening 3, item 15: it replayed, and trained over the whole vocabulary unrenormalised."""
    from posttrain.cli import main

    base = ["rl", *TINY, *SMALL, *TRUNCATED, "steps=1", "report_to=[]", "reward_workers=0", "preflight=false"]
    base += ["rewards=[tests.train.test_rl:vowel_share]"]
    assert main([*base, "record_rollouts=true", f"output_dir={tmp_path / 'recorded'}"]) == 0
    capsys.readouterr()
    replay = [f"rollout.replay={tmp_path / 'recorded' / 'rollouts'}", f"output_dir={tmp_path / 'replayed'}"]
    assert main([*base, *replay, "rollout.keep_sampling_mask=true"]) == 2
    err = capsys.readouterr().err
    assert "recorded without the sampler's kept sets" in err and "Traceback" not in err
    assert not (tmp_path / "replayed").exists()
    assert main([*base, *replay]) == 0  # without the option the same recording replays
