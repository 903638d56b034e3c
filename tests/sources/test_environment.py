"""The environment rollout source on a tiny model: episodes become batches whose policy tokens
are exactly what the engine sampled, whose environment tokens are context only, whose turn
rewards sit on the turns' last tokens, and whose broken episodes are counted, never scored 0."""

from __future__ import annotations

import asyncio
import importlib
import math
import threading
import time

import pytest
import torch

from posttrain.envs import TemplatePrefixError
from posttrain.envs.section import EnvSection
from posttrain.models.chat import chat_prompt_ids
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.sources.environment import EnvironmentErrors, EnvironmentSource
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_sources import sampling_plan

BASE = ["model.tiny.layers=1", "data.task=reverse", "prompts_per_step=3", "samples_per_prompt=2"]
RECEIVED: dict[int, list[str]] = {}  # per row id: what the environments of that row received


class Echo:
    """Answers every turn with a fixed observation; reward 0.25 a turn, done after ``turns``;
    raises or hangs at turn 2 for rows that ask for it."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, row):
        self.row, self.turn = row, 0
        RECEIVED.setdefault(row["id"], [])
        return [{"role": "user", "content": f"go {row['id']}"}]

    def step(self, completion):
        self.turn += 1
        RECEIVED[self.row["id"]].append(completion)
        if self.turn == 2 and self.row.get("fail") == "raise":
            raise RuntimeError("broken tool")
        if self.turn == 2 and self.row.get("fail") == "hang":
            time.sleep(5)
        done = self.turn >= self.turns
        return (None if done else [{"role": "user", "content": "more"}]), 0.25, done


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    return model, tokenizer


class RecordingEngine:
    """The real engine, keeping what it sampled for each prompt it was given."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        rollouts = self.engine.generate(prompts, sampling)
        rows = [prompt for prompt in prompts for _ in range(sampling.n)]  # n samples of each prompt
        for prompt, ids, n in zip(rows, rollouts.response_ids, rollouts.response_lengths, strict=True):
            self.sampled.append((list(prompt), ids[: int(n)].tolist()))
        return rollouts


def source_for(policy, rows, overrides=(), **env):
    model, tokenizer = policy
    # a random policy rarely samples EOS: turns end at a vowel (a stop string) or at 12 tokens
    config = load_rl_config(None, [*BASE, "max_new_tokens=12", "sampling.stop=[a,e,i,o,u,A,E]", *overrides])
    section = EnvSection(name="tests.sources.test_environment:Echo", **env)
    engine = RecordingEngine(build_engine(model, tokenizer))
    return EnvironmentSource(
        sampling_plan(config), section, engine, tokenizer, rows, None, context_limit=512, echo=lambda s: None
    )


def unpadded(batch, i):
    prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
    attended = batch.response_attention[i].bool()
    return prompt, batch.response_ids[i][attended].tolist(), batch.response_mask[i][attended].tolist()


def received() -> dict[int, list[str]]:
    """RECEIVED of the module that env.name imports (pytest may import this file under another name)."""
    import importlib

    return importlib.import_module("tests.sources.test_environment").RECEIVED


def test_episodes_keep_sampled_tokens_verbatim_and_environment_tokens_out_of_the_loss(policy):
    received().clear()
    rows = [{"id": i} for i in range(3)]
    source = source_for(policy, rows)
    batch, metrics = source.next_batch(1)
    _, tokenizer = policy
    assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    for i in range(len(batch)):
        prompt, response, mask = unpadded(batch, i)
        assert tokenizer.decode(prompt) == tokenizer.decode(chat_prompt_ids(tokenizer, batch.prompts[i]))
        # every policy turn is one engine call's output, verbatim, at mask 1, in order
        turns, current = [], []
        for token, m in zip(response, mask, strict=True):
            if m:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        turns += [current] if current else []
        calls = [sampled for context, sampled in source.engine.sampled if context[: len(prompt)] == prompt]
        full = prompt + response
        for turn in turns:
            assert any(turn == sampled[: len(turn)] for sampled in calls)
        # what the environment received is the decoded sampled turn (special tokens skipped)
        decoded = [tokenizer.decode(turn, skip_special_tokens=True) for turn in turns]
        assert [m["content"] for m in batch.completions[i] if m["role"] == "assistant"] == decoded
        # the environment's tokens: the template's rendering of its turns, never trained
        observed = [t for t, m in zip(response, mask, strict=True) if not m]
        assert "more" in tokenizer.decode(observed) or len(turns) == 1
        assert len(full) == len(prompt) + len(response)
    # the environment received every turn, those cut by max_new_tokens too (answered, and flagged)
    sent = [text for texts in received().values() for text in texts]
    answered = [m["content"] for conversation in batch.completions for m in turns_of(conversation)]
    assert sorted(sent) == sorted(answered)
    assert metrics["env/errors"] == 0
    assert metrics["env/turns_mean"] == sum(len(turns_of(c)) for c in batch.completions) / len(batch)
    assert max(len(turns_of(c)) for c in batch.completions) == 3  # some episode went the whole way


def turns_of(conversation):
    return [m for m in conversation if m["role"] == "assistant"]


def test_turn_rewards_sit_on_each_turns_last_sampled_token_and_sum_to_the_score(policy):
    source = source_for(policy, [{"id": i} for i in range(3)], discount=0.5)
    batch, _ = source.next_batch(1)
    for i in range(len(batch)):
        mask = batch.response_mask[i]
        ends = [t for t in range(len(mask)) if mask[t] == 1 and (t + 1 == len(mask) or mask[t + 1] == 0)]
        answered = ends  # every turn is answered, one cut by max_new_tokens too
        assert torch.nonzero(batch.turn_rewards[i]).flatten().tolist() == answered
        expected = [0.25 * 0.5**k for k in range(len(answered))]  # γ^(k-1)·r_k
        assert batch.turn_rewards[i][answered].tolist() == expected
        assert batch.scores[i].item() == pytest.approx(sum(expected))


@pytest.mark.parametrize("fail", ["raise", "hang"])
def test_a_broken_environment_ends_its_episode_as_a_counted_error_never_reward_0(policy, fail):
    rows = [{"id": 0}, {"id": 1, "fail": fail}, {"id": 2}]
    source = source_for(policy, rows, timeout_s=0.5)
    batch, metrics = source.next_batch(1)
    nan = [math.isnan(batch.scores[i].item()) for i in range(len(batch))]
    broken = [i for i in range(len(batch)) if nan[i]]

    # the failing row's episodes that reached turn 2 are errors; the others are scored as usual
    def answered_turns(i):
        return len(turns_of(batch.completions[i]))

    reached = [i for i in range(len(batch)) if batch.columns["fail"][i] == fail and answered_turns(i) >= 2]
    assert broken == reached and broken, (broken, reached)
    assert metrics["env/errors"] == pytest.approx(len(broken) / 6)
    # above the stated share the run stops, naming the first error
    strict = source_for(policy, rows, timeout_s=0.5, max_error_fraction=0.1)
    cause = "RuntimeError: broken tool" if fail == "raise" else "did not return within 0.5 s"
    with pytest.raises(EnvironmentErrors, match=rf"{len(broken)} of 6 episodes.*0\.1.*{cause}"):
        strict.next_batch(1)


def test_budgets_cut_episodes_and_flag_them(policy):
    source = source_for(policy, [{"id": i} for i in range(3)], max_turns=2)
    batch, metrics = source.next_batch(1)
    assert batch.truncated.all() and metrics["env/truncated"] == 1.0
    assert max(len(turns_of(c)) for c in batch.completions) == 2


def test_the_same_step_plays_the_same_episodes(policy):
    first, _ = source_for(policy, [{"id": i} for i in range(3)]).next_batch(4)
    again, _ = source_for(policy, [{"id": i} for i in range(3)]).next_batch(4)
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.engine_logprobs, again.engine_logprobs)


def test_a_groups_first_turn_is_prefilled_once_and_sampled_for_each_episode(policy):
    from posttrain.sources.environment import repeat_count

    source = source_for(policy, [{"id": i} for i in range(3)])
    calls = []
    generate = source.engine.generate
    source.engine.generate = lambda prompts, sampling: (
        calls.append((len(prompts), sampling.n)) or generate(prompts, sampling)
    )
    batch, _ = source.next_batch(1)
    assert calls[0] == (3, 2)  # 3 rows x 2 episodes: 3 contexts, each sampled twice
    assert all(n == 1 for _, n in calls[1:])  # later turns differ by what each episode sampled
    assert batch.response_ids.shape[0] == 6 and not torch.equal(batch.response_ids[0], batch.response_ids[1])
    assert repeat_count([[1], [1], [2], [2]]) == 2 and repeat_count([[1], [1], [2]]) == 1
    assert repeat_count([[1], [1], [1], [2]]) == 1 and repeat_count([[1], [2]]) == 1 and repeat_count([]) == 1


class Overlapping:
    """Counts the steps in flight at once (``PEAK``): each step waits a little, sync or async."""

    IN_FLIGHT, PEAK, LOCK = 0, 0, threading.Lock()

    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    @staticmethod
    def enter():
        with Overlapping.LOCK:  # (the class's own counters, also for the subclass)
            Overlapping.IN_FLIGHT += 1
            Overlapping.PEAK = max(Overlapping.PEAK, Overlapping.IN_FLIGHT)

    @staticmethod
    def leave():
        with Overlapping.LOCK:
            Overlapping.IN_FLIGHT -= 1

    def step(self, completion):
        self.enter()
        time.sleep(0.1)
        self.leave()
        return None, 1.0, True


class OverlappingAsync(Overlapping):
    async def step(self, completion):
        self.enter()
        await asyncio.sleep(0.1)
        self.leave()
        return None, 1.0, True


@pytest.mark.parametrize("kind", ["Overlapping", "OverlappingAsync"])
@pytest.mark.parametrize("limit", [1, 4])
def test_environments_step_concurrently_up_to_max_concurrent(policy, kind, limit):
    model, tokenizer = policy
    config = load_rl_config(None, [*BASE, "max_new_tokens=4"])  # 3 rows x 2 episodes
    section = EnvSection(name=f"tests.sources.test_environment:{kind}", max_concurrent=limit)
    source = EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, [{}] * 3, None, 512
    )
    counter = importlib.import_module("tests.sources.test_environment").Overlapping
    counter.PEAK = 0
    batch, metrics = source.next_batch(1)
    assert metrics["env/errors"] == 0 and batch.scores.tolist() == [pytest.approx(1.0)] * 6
    # six episodes step in the same turn: at most `limit` of them at once, and more than one if allowed
    assert (counter.PEAK == 1) if limit == 1 else (2 <= counter.PEAK <= limit)


def test_sampled_evaluation_plays_eval_k_episodes_per_row_from_the_same_draws(policy):
    rows = [{"id": i} for i in range(3)]
    source = source_for(policy, rows, overrides=["eval_k=2"])
    resets = []
    source.factory = lambda make=source.factory: resets.append(1) or make()
    first = source.evaluate(rows)
    assert len(resets) == 3 + 2 * 3  # one greedy episode per row, then two sampled ones
    assert len(source.last_result) == 3  # the greedy ones are the samples a caller prints
    assert {k for k in first if k.startswith("eval/sampled_")} == {
        f"eval/sampled_{name}" for name in ("turns_mean", "errors", "truncated", "done", "reward")
    }
    assert first == source.evaluate(rows)  # every evaluation samples the same draws
    assert "eval/sampled_reward" not in source_for(policy, rows).evaluate(rows)  # eval_k = 0: greedy only


def turns_written(prompts, completions, **columns):
    """A score of the conversation: 1.0 for an episode of three policy turns, else 0.0."""
    return [float(sum(m["role"] == "assistant" for m in c) == 3) for c in completions]


def test_held_out_episodes_are_scored_by_the_rewards_functions_as_training_scores_them(policy):
    from posttrain.rewards import RewardSet
    from posttrain.rewards.registry import resolve_rewards

    rows = [{"id": i} for i in range(3)] + [{"id": 3, "fail": "raise"}]
    source = source_for(policy, rows, overrides=["eval_k=2"])
    named = resolve_rewards(["tests.sources.test_environment:turns_written"], [2.0])
    source.rewards = RewardSet(named, workers=0)
    metrics = source.evaluate(rows)
    # every finished episode: three turns of 0.25 from the environment, 2 x 1.0 from the function;
    # the broken one has no return and counts as an error, not as a 0
    assert metrics["eval/reward"] == pytest.approx(0.75 + 2.0) and metrics["eval/errors"] == 0.25
    assert metrics["eval/turns_written/mean"] == 1.0 and metrics["eval/turns_written/solved"] == 1.0
    assert metrics["eval/sampled_reward"] == pytest.approx(2.75) and metrics["eval/sampled_turns_written/mean"] == 1.0
    greedy, sampled = source.last_result, source.last_sampled
    assert [e["return"] for e in greedy[:3]] == [pytest.approx(2.75)] * 3 and math.isnan(greedy[3]["return"])
    assert greedy[0]["rewards"] == {"turns_written": 1.0} and greedy[3]["error"] is not None
    assert len(sampled) == 2 * len(rows) and [e["prompt"] for e in sampled[:2]] == [greedy[0]["prompt"]] * 2


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_template_that_rewrites_history_continues_each_episode_as_new_samples(estimator):
    from tests.envs.chat_fixtures import DROPS_NEWLINE, chatml_tokenizer

    tokenizer = chatml_tokenizer(DROPS_NEWLINE)  # every turn boundary loses the newline before it
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    config = load_rl_config(None, [*BASE, f"algorithm={estimator}", "max_new_tokens=6"])
    rows = [{"id": i} for i in range(3)]
    engine = RecordingEngine(build_engine(model, tokenizer))
    section = EnvSection(name="tests.sources.test_environment:Echo", on_prefix_mismatch="new_sample")
    source = EnvironmentSource(sampling_plan(config), section, engine, tokenizer, rows, None, 512)
    batch, metrics = source.next_batch(1)

    # Echo answers three turns: every episode is split into three samples, one per turn
    assert len(batch) == 3 * 6 and metrics["env/turns_mean"] == 3 and metrics["env/errors"] == 0
    assert batch.group_ids.tolist() == [g for g in range(3) for _ in range(2 * 3)]
    assert batch.scores.tolist() == [pytest.approx(0.75)] * 18  # each sample carries the episode's return
    assert batch.turn_rewards.sum(-1).tolist() == [pytest.approx(0.25)] * 18  # and its own turn's reward
    for i, (prompt_sent, sampled) in enumerate(engine.sampled):
        # the engine continued exactly each sample's prompt and sampled exactly its trained tokens
        prompt, response, mask = unpadded(batch, _sample_of_generation(i))
        assert prompt == prompt_sent and response == sampled and set(mask) == {1}
    # a later sample's prompt is the template's own rendering of the conversation so far
    conversation = [{"role": "user", "content": f"go {batch.columns['id'][0]}"}]
    for turn in range(3):
        prompt, response, _ = unpadded(batch, turn)
        assert prompt == chat_prompt_ids(tokenizer, conversation)
        conversation += [{"role": "assistant", "content": batch.completions[0][2 * turn]["content"]}]
        conversation += [{"role": "user", "content": "more"}]
    # the default stops at the first rewrite, naming the turn
    strict = EnvironmentSource(
        sampling_plan(config), EnvSection(name=section.name), RecordingEngine(engine.engine), tokenizer, rows, None, 512
    )
    with pytest.raises(TemplatePrefixError, match="turn 1"):
        strict.next_batch(1)


def _sample_of_generation(i: int) -> int:
    """Which batch sample the i-th generated row is: generations go turn by turn over the six
    episodes; the batch lists each episode's three samples in turn order."""
    turn, episode = divmod(i, 6)
    return episode * 3 + turn


def test_continuing_as_new_samples_needs_a_group_estimator():
    with pytest.raises(Exception, match=r"on_prefix_mismatch = 'new_sample'.*group estimator"):
        load_rl_config(None, [*RUN, "algorithm=ppo", "env.on_prefix_mismatch=new_sample"])
    assert load_rl_config(None, [*RUN, "env.on_prefix_mismatch=new_sample"]).env.on_prefix_mismatch == "new_sample"


RUN = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=support_bot"]
RUN += ["data.n_train=24", "data.n_eval=6", "eval_size=6", "prompts_per_step=3", "samples_per_prompt=2"]
RUN += ["max_new_tokens=12", "env.name=support_bot", "env.max_turns=3", "steps=2", "log_every=100"]
RUN += ["learning_rate=1e-3", "log_samples=6", 'sampling.stop=["?", e, a]']


def bot_vowel_share(prompts, completions, **columns):
    """Share of vowels in the bot's turns: it varies between a random model's episodes, whose
    support_bot returns are all alike (never resolved), so every estimator has a signal."""
    texts = [" ".join(m["content"] for m in c if m["role"] == "assistant") for c in completions]
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in texts]


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo"])
def test_grpo_rloo_and_ppo_train_on_episodes_unchanged(tmp_path, algorithm):
    from posttrain.telemetry.metrics import read_jsonl
    from posttrain.train.rl import OnlineRL

    spread = "rewards=[tests.sources.test_environment:bot_vowel_share]"
    config = load_rl_config(None, [*RUN, spread, f"algorithm={algorithm}", f"output_dir={tmp_path / 'run'}"])
    run = OnlineRL(config, echo=lambda line: None)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    history = run.run()
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        assert record["env/errors"] == 0 and 1 <= record["env/turns_mean"] <= 3
        assert math.isfinite(record["loss/policy"]) and "env/resolved" in record
    assert {"eval/resolved", "eval/turns_mean", "eval/reward"} <= set(history[-1])
    assert all(record["advantage/abs_max"] > 0 and record["policy/grad_norm"] > 1e-4 for record in history)
    assert any(not torch.equal(before[k], v) for k, v in run.policy.state_dict().items())
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    conversation = samples[0]["completion"]
    assert conversation[0]["role"] == "assistant" and {m["role"] for m in conversation} <= {"assistant", "user"}


def test_env_keys_are_checked_before_the_model_loads(tmp_path):
    from posttrain.envs import EnvSpecError
    from posttrain.train.rl import OnlineRL

    config = load_rl_config(None, [*RUN, "env.name=suport_bot", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(EnvSpecError, match=r"env\.name.*support_bot"):
        OnlineRL(config, echo=lambda line: None)


GUESS_ENVS = '''
class GuessNumber:
    """A user's environment: only the contract (no posttrain import). Guess a digit in three tries."""

    def __init__(self, tries=3):
        self.tries = tries

    def reset(self, row):
        self.secret, self.turn = sum(map(ord, str(row))) % 10, 0
        return "guess my digit:"

    async def step(self, completion):  # async def is awaited as well
        self.turn += 1
        digits = [c for c in completion if c.isdigit()]
        if digits and int(digits[0]) == self.secret:
            return None, 1.0, True
        hint = "no digit." if not digits else ("higher." if int(digits[0]) < self.secret else "lower.")
        return (None if self.turn >= self.tries else f" {hint} again:"), 0.0, self.turn >= self.tries
'''


def test_a_user_environment_class_trains_from_the_cli_by_env_name_alone(tmp_path, monkeypatch):
    from posttrain.cli import main
    from posttrain.telemetry.metrics import read_jsonl

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "guess_envs.py").write_text(GUESS_ENVS)
    (tmp_path / "config.yaml").write_text(
        "model: {tiny: {layers: 1, hidden: 32, heads: 2}}\n"
        "data: {task: support_bot, n_train: 12, n_eval: 4}\n"
        "env: {name: support_bot, max_turns: 3}\n"
        "algorithm: grpo\nsteps: 2\nprompts_per_step: 2\nsamples_per_prompt: 2\nmax_new_tokens: 6\n"
        "eval_size: 4\nlog_every: 100\noutput_dir: run\nreport_to: []\n"
    )
    assert main(["rl", "--config", "config.yaml", "env.name=guess_envs:GuessNumber"]) == 0
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "env/turns_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["env/errors"] == 0 for r in steps)
    assert (tmp_path / "run" / "final").is_dir()
    conversations = [r["completion"] for r in read_jsonl(tmp_path / "run" / "samples.jsonl")]
    hints = [m["content"] for c in conversations for m in c if m["role"] == "user"]
    assert hints and all(h.endswith("again:") for h in hints)  # the class's own answers
    assert max(len(c) for c in conversations) <= 5  # its three tries: guess, hint, guess, hint, guess


class BlocksItsLoop:
    """An async environment whose step blocks the event loop (time.sleep inside async def)."""

    async def reset(self, row):
        return "go"

    async def step(self, completion):
        time.sleep(30)
        return None, 1.0, True


def test_an_async_step_that_blocks_the_event_loop_ends_the_run_within_its_timeout(policy):
    """Issue 45, item 2: it hung forever (wait_for cannot cancel a coroutine that never yields)."""
    from posttrain.envs.event_loop import EventLoopStalled

    model, tokenizer = policy
    config = load_rl_config(None, [*BASE, "max_new_tokens=4"])
    section = EnvSection(name="tests.sources.test_environment:BlocksItsLoop", timeout_s=1.0)
    source = EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, [{}] * 3, None, 512
    )
    started = time.perf_counter()
    with pytest.raises(EventLoopStalled, match=r"'tests\.sources\.test_environment:BlocksItsLoop': step of turn 1"):
        source.next_batch(1)
    assert time.perf_counter() - started < 1.0 + 4.0
    source.close()  # returns although the loop's thread is still asleep


class KeepsAQueue:
    """Keeps asyncio resources from reset to the last step: a queue fed by a task it started."""

    async def reset(self, row):
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.feeder = asyncio.get_running_loop().create_task(self._feed())
        return "go"

    async def _feed(self):
        for word in ("one", "two", "three"):
            await asyncio.sleep(0.01)
            await self.queue.put(word)

    async def step(self, completion):
        word = await asyncio.wait_for(self.queue.get(), 2)
        done = word == "three"
        return (None if done else word), 1.0, done


def test_an_async_environment_keeps_asyncio_resources_across_turns(policy):
    model, tokenizer = policy
    config = load_rl_config(None, [*BASE, "max_new_tokens=2"])
    section = EnvSection(name="tests.sources.test_environment:KeepsAQueue", max_turns=5)
    source = EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, [{}] * 3, None, 512
    )
    _, metrics = source.next_batch(1)
    source.close()
    assert metrics["env/errors"] == 0 and metrics["env/turns_mean"] == 3


class SlowAsync:
    async def reset(self, row):
        return "go"

    async def step(self, completion):
        await asyncio.sleep(0.5)
        return None, 1.0, True


def test_64_async_episodes_take_about_the_time_of_one(policy):
    model, tokenizer = policy
    config = load_rl_config(None, ["model.tiny.layers=1", "data.task=reverse", "prompts_per_step=8",
                                   "samples_per_prompt=8", "max_new_tokens=2"])  # fmt: skip
    section = EnvSection(name="tests.sources.test_environment:SlowAsync", max_concurrent=64)
    source = EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, [{}] * 8, None, 512
    )
    _, metrics = source.next_batch(1)
    source.close()
    assert metrics["env/errors"] == 0
    assert metrics["time/env_s"] < 0.5 * 4  # 64 steps of 0.5 s each, interleaved: not 32 s


class BrokenConstructor(SlowAsync):
    def __init__(self):
        raise OSError("the tool server is not running")


def test_an_environment_whose_constructor_raises_ends_the_run_with_one_message(policy):
    from posttrain.envs import EnvSpecError

    model, tokenizer = policy
    config = load_rl_config(None, [*BASE, "max_new_tokens=2"])
    section = EnvSection(name="tests.sources.test_environment:BrokenConstructor")
    source = EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, [{}] * 3, None, 512
    )
    with pytest.raises(EnvSpecError, match=r"could not be built with env\.options \{\}: OSError: the tool server"):
        source.next_batch(1)


class LongFirstObservation(SlowAsync):
    async def reset(self, row):
        return "x" * 600


def test_a_first_observation_longer_than_the_context_is_an_error_not_an_empty_success(policy):
    """Issue 45, items 4-5: it 'succeeded' training on nothing; every episode erroring ended in 'no
    sample of this batch has a reward' whatever env.max_error_fraction said."""
    from posttrain.sources.environment import EnvironmentErrors

    model, tokenizer = policy
    config = load_rl_config(None, [*BASE, "max_new_tokens=4"])
    section = EnvSection(name="tests.sources.test_environment:LongFirstObservation", max_error_fraction=1.0)
    source = EnvironmentSource(
        sampling_plan(config), section, build_engine(model, tokenizer), tokenizer, [{}] * 3, None, 512
    )
    with pytest.raises(EnvironmentErrors, match=r"every one of the 6 episodes .* no room for a response within 512"):
        source.next_batch(1)
