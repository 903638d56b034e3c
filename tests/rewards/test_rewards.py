"""The reward interface (TRL signature, columns, None, async, weights) and the built-in rules."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
import time

import pytest
import torch

from posttrain.rewards import REWARDS, NamedReward, RewardFunctionError, RewardOutput, RewardSet, resolve_reward
from posttrain.rewards.math_answer import answers_match, extract_answer


def score(specs, prompts, completions, **columns):
    rewards = RewardSet([resolve_reward(s) if not isinstance(s, tuple) else resolve_reward(*s) for s in specs])
    ids = [[ord(ch) for ch in c] if isinstance(c, str) else [1] for c in completions]
    return rewards.score(prompts, completions, ids, columns)


def test_reverse_is_the_seeds_check():
    prompts = ["Reverse the name: sean. Answer:"] * 3
    result = score(["reverse"], prompts, [" naes.", " naes. junk", " nae."])
    assert result.scores.tolist() == [1.0, 1.0, 0.0]


def test_weights_none_and_components_are_kept():
    def half(prompts, completions, completion_ids, **_):
        return [0.5, None, None]

    def other(prompts, completions, completion_ids, **_):
        return [1.0, 2.0, None]

    result = score([(half, 2.0), (other, 1.0)], ["p", "q", "r"], ["a", "b", "c"])
    assert result.names == ["half", "other"]
    assert result.components[1, 0].isnan() and result.components[1, 1] == 2.0
    # three prompts: Σ w·r over the components that apply to each (`half` scores none of "q"'s
    # samples); a sample with none present is NaN (masked), never 0
    assert result.scores[:2].tolist() == [2.0 * 0.5 + 1.0, 2.0] and result.scores[2].isnan()
    assert result.metrics["reward/half/none_fraction"] == pytest.approx(2 / 3)


def test_every_dataset_column_reaches_the_function_and_extra_metrics_are_logged():
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(columns, completion_ids=completion_ids)
        return RewardOutput([1.0, 0.0], metrics={"parsed": 0.5})

    result = score([spy], ["p", "q"], ["x", "y"], answer=["1", "2"], difficulty=[3, 4])
    assert seen["answer"] == ["1", "2"] and seen["difficulty"] == [3, 4] and seen["completion_ids"] == [[120], [121]]
    assert result.metrics["reward/spy/parsed"] == 0.5


def test_async_functions_are_awaited_concurrently():
    async def slow_a(prompts, completions, completion_ids, **_):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(prompts, completions, completion_ids, **_):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    def slow_sync(prompts, completions, completion_ids, **_):
        time.sleep(0.3)
        return [3.0] * len(completions)

    start = time.perf_counter()
    result = score([slow_a, slow_b, slow_sync], ["p"], ["c"])
    assert time.perf_counter() - start < 0.75  # serial would take 0.9 s
    assert result.scores.tolist() == [6.0]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda prompts, completions, completion_ids, **_: 1 / 0, "raised ZeroDivisionError"),
        (lambda prompts, completions, completion_ids, **_: [1.0], "returned 1 values for 2 completions"),
        (lambda prompts, completions, completion_ids, **_: ["yes", 1.0], "returned 'yes' for completion 0"),
        (lambda prompts, completions, completion_ids, **_: None, "must return a list"),
        # hardening 3, item 16: text that float() reads was trained as a number
        (lambda prompts, completions, completion_ids, **_: ["1.5", 1.0], "returned '1.5' for completion 0"),
        (lambda prompts, completions, completion_ids, **_: [1.0, b"2"], "returned b'2' for completion 1"),
    ],
)
def test_broken_reward_functions_are_named(bad, message):
    with pytest.raises(RewardFunctionError, match=message) as error:
        score([bad], ["p", "q"], ["x", "y"])
    assert "'<lambda>'" in str(error.value)


def test_user_function_by_dotted_path_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        textwrap.dedent(
            """
            def shout(prompts, completions, completion_ids, **columns):
                return [float(c.isupper()) for c in completions]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "myrewards", raising=False)
    assert score(["myrewards:shout"], ["p", "p"], ["HI", "hi"]).scores.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="has no attribute 'whisper'"):
        resolve_reward("myrewards:whisper")
    with pytest.raises(ValueError, match="cannot import module 'nowhere'"):
        resolve_reward("nowhere:fn")


def test_unknown_builtin_and_bad_options_are_explained():
    with pytest.raises(KeyError, match=r"valid names: .*exact_match.*format.*math"):
        resolve_reward("maths")
    with pytest.raises(ValueError, match="takes no options"):
        resolve_reward({"name": "math", "tolerance": 1})
    with pytest.raises(ValueError, match="bad options"):
        resolve_reward({"name": "line_count", "lines": 5})
    assert {"exact_match", "reverse", "format", "math", "line_count", "length", "overlong"} <= set(REWARDS)


def test_format_reward():
    completions = [
        "<think> 3 + 5 = 8 </think><answer> 8 </answer>",
        " 3 + 5 = 8 </think> <answer>8</answer>",  # the prompt opened the think block
        "<answer> 8 </answer>",
        "<think> x </think><answer> 8 </answer> and more",
    ]
    prompts = ["User: q. Assistant:", "User: q. Assistant: <think>", "p", "p"]
    assert score(["format"], prompts, completions).scores.tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think> 3 + 5 = 8 </think><answer> 8 </answer>", "8"),
        ("so \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
        ("first 3 then 1,250 apples", "1,250"),
        ("no answer here", None),
        ("<answer>7</answer> but later \\boxed{9}", "7"),
    ],
)
def test_answer_extraction(text, expected):
    assert extract_answer(text) == expected


def test_math_answers_compare_by_value():
    assert answers_match("1,250", "1250") and answers_match("8.0", "8") and not answers_match("7", "8")
    assert answers_match("\\frac{1}{2}", "0.5") and answers_match("2/4", "\\frac{1}{2}")
    completions = ["<think>3+5</think><answer> 8 </answer>", "<answer>9</answer>", "I give up", "\\boxed{8}"]
    result = score(["math"], ["p"] * 4, completions, answer=["8"] * 4)
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(RewardFunctionError, match="needs a ground-truth column"):
        score(["math"], ["p"], ["8"], question=["q"])


def test_line_count_length_and_overlong():
    poem = "roses\nare red\n\nviolets\nare blue\nend"
    assert score([{"name": "line_count", "target": 5}], ["p"], [poem]).scores.tolist() == [0.0]
    assert score(["line_count"], ["p"], ["one line"], target_lines=[3]).scores.tolist() == [-2.0]
    assert score([{"name": "length", "target": 4}], ["p"], ["abcdef"]).scores.tolist() == [-0.5]
    overlong = {"name": "overlong", "max_length": 10, "cache_length": 4}
    result = score([overlong], ["p"] * 3, ["a" * 5, "a" * 8, "a" * 10])  # lengths in tokens
    assert torch.allclose(result.scores, torch.tensor([0.0, -0.5, -1.0]))
    assert not math.isnan(result.metrics["reward/overlong/mean"])


def test_preference_rule_reward_is_the_tasks_labelling_rule():
    fn = resolve_reward("preference_rule").fn
    prompts = ["Describe the cat.", "Describe the cat.", "Describe the owl."]
    completions = [" nice calm cat.", " good good good good.", " nice calm cat."]
    assert fn(prompts, completions, None) == [3.0, -2.0, 2.0]


# ---- values a reward must not return silently: ±inf, NaN, missing scores, too many failures ----


def inf_at_ten(prompts, completions, completion_ids, **columns):
    """A worker imports it by name: +inf for the sample at batch index 10."""
    return [math.inf if row == 10 else 0.5 for row in columns["row"]]


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_an_infinite_reward_stops_naming_the_function_the_sample_and_the_value(value):
    def unbounded(prompts, completions, completion_ids, **_):
        return [1.0, value, 0.0]

    with pytest.raises(RewardFunctionError) as error:
        score([unbounded], ["p"] * 3, ["a", "b", "c"])
    message = str(error.value)
    assert "'unbounded'" in message and "completion 1" in message and repr(value) in message


def test_an_infinite_reward_in_a_worker_chunk_names_its_index_in_the_whole_batch():
    rewards = RewardSet([resolve_reward({"name": "tests.rewards.test_rewards:inf_at_ten", "chunks": 2})], workers=2)
    with rewards, pytest.raises(RewardFunctionError, match=r"'inf_at_ten' returned inf for completion 10\b"):
        rewards.score(["p"] * 16, ["c"] * 16, [[1]] * 16, {"row": list(range(16))})


def test_nan_is_no_score_like_none_but_warned_and_counted(caplog):
    def shaky(prompts, completions, completion_ids, **_):
        return [1.0, math.nan, 0.5, math.nan]

    with caplog.at_level("WARNING", logger="posttrain.rewards.compose"):
        result = score([shaky], ["p", "q", "r", "s"], ["a", "b", "c", "d"])
    assert result.scores[[0, 2]].tolist() == [1.0, 0.5] and result.scores[[1, 3]].isnan().all()
    assert result.metrics["reward/shaky/nan"] == 2
    warned = [r.getMessage() for r in caplog.records if "'shaky'" in r.getMessage()]
    assert len(warned) == 1 and "NaN for 2 of 4" in warned[0] and "completion 1" in warned[0]


def test_a_component_missing_where_it_applies_masks_the_sample_instead_of_counting_0():
    def answer(prompts, completions, completion_ids, **_):
        return [1.0, None, 0.0, None]  # sample 1: its prompt is scored by `answer`, it is not

    def style(prompts, completions, completion_ids, **_):
        return [0.5, 0.5, 0.5, 0.5]

    # samples 0-1 answer prompt "p", 2-3 prompt "q": `answer` applies to "p" (it scored sample 0)
    # and to "q"; samples 1 and 3 have no score for it, so their sum is missing, not 0 + 0.5
    result = score([answer, style], ["p", "p", "q", "q"], ["a", "b", "c", "d"])
    assert result.scores[[0, 2]].tolist() == [1.5, 0.5] and result.scores[[1, 3]].isnan().all()
    # explicit groups (the loop's) decide over the prompt text
    grouped = RewardSet([resolve_reward(answer), resolve_reward(style)], workers=0)
    result = grouped.score(["p"] * 4, ["a", "b", "c", "d"], [[1]] * 4, group_ids=torch.tensor([0, 1, 2, 3]))
    assert result.scores.tolist() == [1.5, 0.5, 0.5, 0.5]  # each its own prompt: `answer` applies to 0 and 2


def test_a_reward_that_applies_to_none_of_a_prompts_samples_is_left_out_of_its_sum():
    # TRL's multi-task pattern: a math reward says None for code rows and vice versa
    def math_only(prompts, completions, completion_ids, task, **_):
        return [1.0 if t == "math" else None for t in task]

    def code_only(prompts, completions, completion_ids, task, **_):
        return [0.25 if t == "code" else None for t in task]

    def monitor(prompts, completions, completion_ids, **_):
        return [None, 3.0, None, 3.0]  # weight 0: never masks a sample

    rewards = [resolve_reward(math_only), resolve_reward(code_only), resolve_reward(monitor, 0.0)]
    result = RewardSet(rewards, workers=0).score(
        ["p", "p", "q", "q"], ["a", "b", "c", "d"], [[1]] * 4, {"task": ["math", "math", "code", "code"]}
    )
    assert result.scores.tolist() == [1.0, 1.0, 0.25, 0.25]
    assert result.metrics["reward/math_only/failed_fraction"] == 0.0


def test_more_failures_than_max_failed_fraction_stop_naming_the_function_and_the_counts():
    def flaky(prompts, completions, completion_ids, **_):
        return [1.0, None, None, None]  # one prompt, scored once of four times

    with pytest.raises(RewardFunctionError) as error:
        score([flaky], ["p"] * 4, ["a", "b", "c", "d"])
    message = str(error.value)
    assert "'flaky'" in message and "3 of 4 samples" in message and "3 None/NaN" in message
    assert "max_failed_fraction=0.5" in message
    # the entry's own threshold; a share at the threshold goes on
    entry = {"name": "tests.rewards.test_rewards:three_of_four_none", "max_failed_fraction": 0.75}
    result = score([entry], ["p"] * 4, ["a", "b", "c", "d"])
    assert result.metrics["reward/three_of_four_none/failed_fraction"] == 0.75
    for bad in (-0.1, 1.5, "most"):
        with pytest.raises(ValueError, match="max_failed_fraction must be"):
            resolve_reward({"name": "format", "max_failed_fraction": bad})


def three_of_four_none(prompts, completions, completion_ids, **_):
    return [1.0, None, None, None]


def test_timeouts_count_against_max_failed_fraction_and_mask_their_samples():
    async def slow(prompts, completions, completion_ids, **_):
        await asyncio.sleep(10)

    def fast(prompts, completions, completion_ids, **_):
        return [1.0] * len(completions)

    rewards = RewardSet([NamedReward("slow", slow, timeout_s=0.2), resolve_reward(fast)], workers=0)
    expected = r"'slow' gave no score for 2 of 2 samples of this batch \(2 timed out after 0.2 s"
    with pytest.raises(RewardFunctionError, match=expected) as error:
        rewards.score(["p", "q"], ["a", "b"], [[1], [2]])
    assert "timeout" in str(error.value)
    tolerant = RewardSet(
        [NamedReward("slow", slow, timeout_s=0.2), resolve_reward(fast)], workers=0, max_failed_fraction=1.0
    )
    result = tolerant.score(["p", "q"], ["a", "b"], [[1], [2]])
    assert result.scores.isnan().all()  # a timed-out reward never leaves a sum of the others


def raises_on_its_columns(prompts, completions, answer, **columns):
    """A worker imports it by name: fails as a user's function does on a column it misreads."""
    return [float(int(a) == len(c)) for a, c in zip(answer, completions, strict=True)]


@pytest.mark.parametrize("workers", [0, 2], ids=["in process", "in a worker"])
def test_a_reward_that_raises_shows_examples_of_its_inputs(workers):
    """A newcomer's first hour, item 5: docs/training.md says a reward that raises reports examples
    of its inputs; it named only the error. Each keyword on a line, cut to one."""
    entry = {"name": "tests.rewards.test_rewards:raises_on_its_columns", "chunks": 1}
    rewards = RewardSet([resolve_reward(entry)], workers=workers)
    columns = {"answer": ["five", "6"], "notes": ["x" * 500, "short"]}
    with rewards, pytest.raises(RewardFunctionError) as error:
        rewards.score(["What is 2 + 3?", "And 3 + 3?"], ["5", "6"], [[1], [2]], columns)
    message = str(error.value)
    assert "'raises_on_its_columns' raised ValueError" in message and "its inputs for sample 0:" in message
    assert "    prompts = 'What is 2 + 3?'" in message and "    completions = '5'" in message
    assert "    answer = 'five'" in message and "completion_ids" not in message
    assert max(len(line) for line in message.splitlines() if line.startswith("    notes = ")) == 12 + 100
