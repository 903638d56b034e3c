"""The ``reward_model`` reward: scores equal the model's own forward pass, whatever the
batching; label probabilities; normalisation formulas; errors at config time; chat prompts;
and a reward model trained by ``posttrain rm`` that ranks held-out pairs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from posttrain.models.chat import chat_prompt_ids
from posttrain.models.loading import ModelLoadError
from posttrain.models.reward import build_reward_model
from posttrain.models.tiny import build_tiny_causal_lm, tiny_config
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rewards import RewardSet, resolve_reward
from posttrain.rewards.model_reward import RunningMeanStd

PROMPTS = ["Describe the cat.", "Reverse: sean.", "Hi", "Describe the owl. Use few words.", "Q", "x", "Why?"]
COMPLETIONS = [" nice calm cat.", " naes", " hello there, how are you", " owl.", "", " a", " because it is so"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def scorer_path(tmp_path_factory, tokenizer):
    """A 1-label scorer with random weights, saved like `posttrain rm` saves one."""
    path = tmp_path_factory.mktemp("scorer")
    config = tiny_config(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    build_reward_model(config, seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory, tokenizer):
    """A 2-label classifier ("safe", "unsafe"), like a safety model."""
    path = tmp_path_factory.mktemp("classifier")
    config = tiny_config(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer)
    config.id2label, config.label2id = {0: "safe", 1: "unsafe"}, {"safe": 0, "unsafe": 1}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def model_reward(path, **options):
    return resolve_reward({"name": "reward_model", "path": str(path), **options}).fn


def direct_logits(path, rows):
    """Each row alone, through transformers' own forward: no padding, no batching."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([ids])).logits[0] for ids in rows])


def posttrain_ids(tokenizer, prompt, completion):
    """How `posttrain rm` encodes a row: prompt ids + completion ids + EOS."""
    ids = (
        tokenizer(prompt, add_special_tokens=False)["input_ids"]
        + tokenizer(completion, add_special_tokens=False)["input_ids"]
    )
    return [*ids, tokenizer.eos_token_id]


def every_row(tokenizer):
    return [posttrain_ids(tokenizer, p, c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]


def test_scores_equal_a_direct_forward_of_prompt_completion_eos(scorer_path, tokenizer):
    reward = model_reward(scorer_path)
    assert reward._model is None  # weights load on the first call, not at config time
    output = reward(PROMPTS, COMPLETIONS)
    expected = direct_logits(scorer_path, every_row(tokenizer))
    torch.testing.assert_close(torch.tensor(output.values), expected[:, 0], atol=1e-5, rtol=0)
    assert expected[:, 0].std() > 1e-3  # rows score differently, so a mixed-up order would show
    assert output.metrics["raw_mean"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert output.metrics["truncated"] == 0.0


def test_batching_does_not_change_scores(scorer_path):
    one = model_reward(scorer_path, batch_size=1)(PROMPTS, COMPLETIONS).values
    three = model_reward(scorer_path, batch_size=3)(PROMPTS, COMPLETIONS).values
    seven = model_reward(scorer_path, batch_size=7)(PROMPTS, COMPLETIONS).values
    torch.testing.assert_close(torch.tensor(seven), torch.tensor(one), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(three), torch.tensor(one), atol=1e-5, rtol=0)


def test_a_classifier_gives_the_probability_of_the_chosen_label(classifier_path, tokenizer):
    unsafe = model_reward(classifier_path, label="unsafe")(PROMPTS, COMPLETIONS).values
    safe = model_reward(classifier_path, label=0)(PROMPTS, COMPLETIONS).values
    torch.testing.assert_close(torch.tensor(safe) + torch.tensor(unsafe), torch.ones(len(PROMPTS)), atol=1e-6, rtol=0)
    logits = direct_logits(classifier_path, every_row(tokenizer))
    torch.testing.assert_close(torch.tensor(unsafe), logits.softmax(-1)[:, 1], atol=1e-5, rtol=0)
    assert model_reward(classifier_path, label="UNSAFE", output="score")(PROMPTS[:2], COMPLETIONS[:2]).values == (
        pytest.approx(logits[:2, 1].tolist(), abs=1e-5)
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"2 labels \(0=safe, 1=unsafe\); choose one"),
        ({"label": "toxic"}, r"no label 'toxic'; labels: 0=safe, 1=unsafe"),
        ({"label": 2}, "label 2 is out of range"),
        ({"normalize": "whiten"}, "normalize must be one of 'none', 'running', 'batch'"),
        ({"label": 0, "batch_size": 0}, "batch_size"),
        ({"label": 0, "device": "gpu0"}, "not a torch device"),
    ],
)
def test_bad_classifier_options_are_explained_at_config_time(classifier_path, options, message):
    with pytest.raises(ValueError, match=message):
        model_reward(classifier_path, **options)


def test_one_label_models_give_the_raw_score_or_its_sigmoid(scorer_path):
    raw = torch.tensor(model_reward(scorer_path)(PROMPTS, COMPLETIONS).values)
    probability = torch.tensor(model_reward(scorer_path, output="probability")(PROMPTS, COMPLETIONS).values)
    torch.testing.assert_close(probability, torch.sigmoid(raw), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"one output \(a score\), so it has no label to choose"):
        model_reward(scorer_path, label=0)


def test_batch_normalisation_is_a_z_score_within_the_batch(scorer_path):
    raw = torch.tensor(model_reward(scorer_path)(PROMPTS, COMPLETIONS).values)
    output = model_reward(scorer_path, normalize="batch")(PROMPTS, COMPLETIONS)
    expected = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(torch.tensor(output.values), expected, atol=1e-5, rtol=0)
    assert output.metrics["raw_mean"] == pytest.approx(float(raw.mean()), abs=1e-6)


def test_running_normalisation_uses_every_score_seen_so_far(scorer_path):
    raw = torch.tensor(model_reward(scorer_path)(PROMPTS, COMPLETIONS).values, dtype=torch.float64)
    reward = model_reward(scorer_path, normalize="running")
    first = torch.tensor(reward(PROMPTS[:3], COMPLETIONS[:3]).values, dtype=torch.float64)
    second = reward(PROMPTS[3:], COMPLETIONS[3:])
    # the first batch by its own statistics; the second by those of both batches together
    seen = raw[:3]
    torch.testing.assert_close(first, (seen - seen.mean()) / (seen.std(unbiased=False) + 1e-6), atol=1e-5, rtol=0)
    expected = (raw[3:] - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(torch.tensor(second.values, dtype=torch.float64), expected, atol=1e-5, rtol=0)
    assert second.metrics["running_mean"] == pytest.approx(float(raw.mean()), abs=1e-6)
    restored = model_reward(scorer_path, normalize="running")
    restored.load_state_dict(reward.state_dict())
    assert restored.running.state_dict() == reward.running.state_dict()


def test_running_mean_std_matches_the_statistics_of_everything_seen():
    torch.manual_seed(0)
    batches = [torch.randn(5) * 3 + 1, torch.randn(1), torch.randn(12) - 4, torch.empty(0)]
    stats = RunningMeanStd()
    for batch in batches:
        stats.update(batch)
    everything = torch.cat(batches).double()
    assert stats.count == 18
    assert stats.mean == pytest.approx(float(everything.mean()), abs=1e-12)
    assert stats.std == pytest.approx(float(everything.std(unbiased=False)), abs=1e-12)
    hand = RunningMeanStd()
    hand.update(torch.tensor([1.0, 3.0]))
    hand.update(torch.tensor([5.0]))
    assert (hand.mean, hand.std**2) == pytest.approx((3.0, 8 / 3))  # mean 3, variance (4 + 0 + 4) / 3


def test_long_rows_lose_the_start_of_the_prompt(scorer_path, tokenizer):
    prompt, completion = "a long prompt that will not fit whole", " short answer"
    output = model_reward(scorer_path, max_length=20)([prompt, "p"], [completion, " c"])
    ids = posttrain_ids(tokenizer, prompt, completion)[-20:]
    expected = direct_logits(scorer_path, [ids, posttrain_ids(tokenizer, "p", " c")])[:, 0]
    torch.testing.assert_close(torch.tensor(output.values), expected, atol=1e-5, rtol=0)
    assert output.metrics["truncated"] == 0.5


def test_conversational_prompts_go_through_the_chat_template(scorer_path, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe the fox."}]
    completions = [" calm fox.", [{"role": "assistant", "content": " old fox."}]]
    output = model_reward(scorer_path)([messages, messages], completions)
    # as the rollout produced it: the template's generation prompt, then the completion and EOS
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    rows = [[*prompt_ids, *tokenizer(t, add_special_tokens=False)["input_ids"], 2] for t in (" calm fox.", " old fox.")]
    torch.testing.assert_close(torch.tensor(output.values), direct_logits(scorer_path, rows)[:, 0], atol=1e-5, rtol=0)
    # the Hub way: the whole conversation through the template, the completion as the assistant turn
    chat = model_reward(scorer_path, encoding="chat")([messages], [" calm fox."])
    whole = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": " calm fox."}], tokenize=False)
    expected = direct_logits(scorer_path, [tokenizer(whole, add_special_tokens=False)["input_ids"]])[0, 0]
    assert chat.values[0] == pytest.approx(float(expected), abs=1e-5)


def test_completion_only_scoring(scorer_path, tokenizer):
    alone = model_reward(scorer_path, include_prompt=False)(["any prompt", "other"], [" yes", " yes"]).values
    assert alone[0] == pytest.approx(alone[1], abs=1e-6)
    expected = direct_logits(scorer_path, [posttrain_ids(tokenizer, "", " yes")])[0, 0]
    assert alone[0] == pytest.approx(float(expected), abs=1e-5)


def test_bad_paths_fail_at_config_time_naming_the_path(tmp_path, tokenizer):
    with pytest.raises(ModelLoadError, match=r"reward_model: model path '.*nowhere' does not exist"):
        model_reward(tmp_path / "nowhere")
    policy = tmp_path / "policy"
    build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer).save_pretrained(policy)
    with pytest.raises(ModelLoadError, match=r"policy holds LlamaForCausalLM, not a sequence classifier"):
        model_reward(policy)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    config = (policy / "config.json").read_text()
    (weightless / "config.json").write_text(config.replace("ForCausalLM", "ForSequenceClassification"))
    with pytest.raises(ModelLoadError, match=r"weightless has config\.json but no weights"):
        model_reward(weightless)


def test_in_a_reward_set_it_runs_in_process_next_to_pooled_rules(scorer_path):
    entry = resolve_reward({"name": "reward_model", "path": str(scorer_path), "alias": "rm", "batch_size": 2})
    with RewardSet([entry, resolve_reward("format")], workers=1) as rewards:
        assert rewards.modes == {"rm": "in_process", "format": "pool"}
        result = rewards.score(PROMPTS[:3], COMPLETIONS[:3], [[1]] * 3)
    direct = model_reward(scorer_path)(PROMPTS[:3], COMPLETIONS[:3]).values
    assert result.components[:, 0].tolist() == pytest.approx(direct, abs=1e-6)
    assert "reward/rm/raw_mean" in result.metrics and result.metrics["reward/rm/timeouts"] == 0


@pytest.mark.slow
def test_a_reward_model_trained_by_posttrain_rm_ranks_held_out_pairs(tmp_path):
    from posttrain.cli import main
    from posttrain.data.tasks.preference import split_pairs

    out = tmp_path / "rm"
    tiny = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=preference"]
    args = ["data.n_train=480", "data.n_eval=64", "steps=30", "batch_size=16", "learning_rate=3e-3", "warmup_steps=0"]
    assert main(["rm", *tiny, *args, f"output_dir={out}"]) == 0
    _, held_out = split_pairs(480, 64, seed=0)
    reward = model_reward(out / "final")
    prompts = [row["prompt"] for row in held_out]
    chosen = torch.tensor(reward(prompts, [row["chosen"] for row in held_out]).values)
    rejected = torch.tensor(reward(prompts, [row["rejected"] for row in held_out]).values)
    accuracy = float((chosen > rejected).float().mean())
    assert accuracy > 0.6
    # the same encoding as training: the trainer's own held-out evaluation gets the same share
    summary = json.loads((out / "summary.json").read_text())
    assert accuracy == summary["last_step"]["eval/pairwise_accuracy"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_one_fails_at_config_time(scorer_path):
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        model_reward(scorer_path, device="cuda")
    assert model_reward(scorer_path, device="auto").device == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scores_on_the_gpu_in_bfloat16_match_the_cpu(scorer_path):
    cpu = torch.tensor(model_reward(scorer_path)(PROMPTS, COMPLETIONS).values)
    gpu = torch.tensor(model_reward(scorer_path, device="cuda", dtype="bfloat16")(PROMPTS, COMPLETIONS).values)
    torch.testing.assert_close(gpu, cpu, atol=0.05 * float(cpu.abs().max()), rtol=0)
