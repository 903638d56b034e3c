"""A critic started from a reward model (``algorithm.critic.init_from``): its body and its value
head are the reward model's, so its first values are the model's scores read at every position;
a folder with another vocabulary is refused before any model loads."""

from __future__ import annotations

import torch

from posttrain.cli import main
from posttrain.models.reward import build_reward_model
from posttrain.models.tiny import tiny_config
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.models.value import value_head
from tests.train.test_rl import make_run


def reward_model_folder(tmp_path, vocab: int):
    scorer = build_reward_model(tiny_config(vocab, layers=1, hidden=32, heads=2), pad_token_id=0, seed=3)
    with torch.no_grad():
        scorer.score.weight.normal_(generator=torch.Generator().manual_seed(5))  # a head that is not zero
    scorer.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm", scorer


def test_a_ppo_critic_starts_as_the_reward_model(tmp_path):
    folder, scorer = reward_model_folder(tmp_path, len(build_char_tokenizer()))
    run = make_run(tmp_path, ["algorithm=ppo", "steps=1", f"algorithm.critic.init_from={folder}"])
    head = value_head(run.critic)
    torch.testing.assert_close(head.weight, scorer.score.weight)
    assert head.bias is None or not head.bias.any()
    body, theirs = run.critic.base_model.state_dict(), scorer.base_model.state_dict()
    assert body.keys() == theirs.keys() and all(torch.equal(body[k], theirs[k]) for k in body)
    ids = torch.randint(3, 40, (2, 7))
    with torch.no_grad():
        values = run.critic(input_ids=ids).logits[..., 0]
        scores = scorer(input_ids=ids).logits[:, 0]  # the scorer reads the last position
    torch.testing.assert_close(values[:, -1], scores, atol=1e-5, rtol=0)
    history = run.run()
    assert "loss/value" in history[-1]


def test_a_critic_folder_with_another_vocabulary_is_refused_before_loading(tmp_path, capsys):
    folder, _ = reward_model_folder(tmp_path, 77)
    args = ["rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
            "algorithm=ppo", f"algorithm.critic.init_from={folder}", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "algorithm.critic.init_from" in err and "vocabulary of 77 tokens" in err and "Traceback" not in err


def test_a_light_critic_from_a_reward_model_trains_adapters_over_its_frozen_body(tmp_path):
    """``model.lora`` with ``init_from``: the critic is the reward model's body, frozen under
    adapters of its own, and its head (trained in full); it starts as the reward model scores."""
    folder, scorer = reward_model_folder(tmp_path, len(build_char_tokenizer()))
    run = make_run(tmp_path, ["algorithm=ppo", "steps=2", f"algorithm.critic.init_from={folder}", "model.lora.r=4"])
    trained = {name for name, p in run.critic.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or "score" in name for name in trained)
    ids = torch.randint(3, 40, (2, 7))
    with torch.no_grad():
        values = run.critic(input_ids=ids).logits[..., 0]
        scores = scorer(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(values[:, -1], scores, atol=1e-5, rtol=0)
    frozen = {name: p.clone() for name, p in run.critic.named_parameters() if not p.requires_grad}
    history = run.run()
    assert all(h["loss/value"] > 0 for h in history if "loss/value" in h)
    now = dict(run.critic.named_parameters())
    assert all(torch.equal(now[name], tensor) for name, tensor in frozen.items())  # the body did not move
    head = run.critic.get_base_model().score.modules_to_save["default"].weight
    assert not torch.equal(head, scorer.score.weight)  # the head trained
