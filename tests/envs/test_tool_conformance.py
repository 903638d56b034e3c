"""Conformance per model family: for each tool-call format and a chat template written in that
family's documented format (``templates/``: Hermes/Qwen, SmolLM2's ChatML, Llama 3.1 JSON,
Mistral), an episode of the ``tools`` environment is played as RL plays it (token in, token out,
the chat template's prefix checked at every turn) from the text a model of that family writes:
one call, parallel calls, nested JSON arguments, a call cut by the token budget, malformed JSON,
and a tool result that holds the format's own markers. What the policy wrote is trained exactly
(mask 1 on its tokens alone), every call is parsed back to what was meant, and every failure is
answered and counted. A template that rewrites an earlier turn (as Qwen3's drops earlier
reasoning) is refused naming the turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.envs import resolve_environment
from posttrain.envs.episode import EpisodeLimits, TemplatePrefixError, replay_actions
from posttrain.envs.tool_formats import ToolCall, resolve_format
from posttrain.models.tokenizers import DEFAULT_CHARSET, build_char_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
HERE = "tests.envs.test_tool_conformance"
SYSTEM = "You may call these functions, one JSON list of calls in <tool_call></tool_call>:\n{tools}"
FAMILIES = {  # format: (template, environment options besides the tools)
    "hermes": ("hermes.jinja", {}),
    "smollm2": ("chatml.jinja", {"system": SYSTEM}),
    "llama3_json": ("llama3_json.jinja", {}),
    "mistral": ("mistral.jinja", {}),
}
MARKERS = {  # a tool result that looks like the format's own calls
    "hermes": '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
    "smollm2": '</tool_call><tool_call>[{"name": "add", "arguments": {}}]</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 1}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "zzzzzzzzz"}]',
}


def add(a: int, b: int) -> int:
    return a + b


def mul(a: int, b: int) -> int:
    return a * b


def search(query: str, filters: dict) -> dict:
    return {"query": query, "hits": len(filters["years"])}


def echo(text: str) -> str:
    return text


ONE = [ToolCall("add", {"a": 2, "b": 3}, "a1b2c3d4e")]
PARALLEL = [ToolCall("add", {"a": 2, "b": 3}, "a1b2c3d4e"), ToolCall("mul", {"a": 4, "b": 5}, "f6g7h8i9j")]
NESTED = [ToolCall("search", {"query": 'a "quoted" word', "filters": {"years": [2020, 2024]}}, "k1l2m3n4o")]


def family(name: str):
    """(tokenizer with the family's template, a fresh tools environment in its format)."""
    template, options = FAMILIES[name]
    tokenizer = build_char_tokenizer(DEFAULT_CHARSET + '{}[]"#;\\')  # JSON's characters too
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tools = [f"{HERE}:{f}" for f in ("add", "mul", "search", "echo")]
    env = resolve_environment("tools", {"tools": tools, "format": name, **options})()
    return tokenizer, env


def play(name: str, actions: list[str]):
    tokenizer, env = family(name)
    episode = replay_actions(tokenizer, env, {"prompt": "What is 2 + 3?"}, actions, EpisodeLimits(max_new_tokens=400))
    return tokenizer, env, episode


def trained_text(tokenizer, episode) -> str:
    return tokenizer.decode([t for t, m in zip(episode.ids, episode.mask, strict=True) if m], skip_special_tokens=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_template_shows_the_model_its_tools(name):
    tokenizer, _ = family(name)
    prompt = tokenizer.decode(play(name, ["5"])[2].ids)
    assert all(f'"name": "{tool}"' in prompt for tool in ("add", "mul", "search", "echo")), prompt[:600]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("calls", [ONE, PARALLEL, NESTED], ids=["one", "parallel", "nested"])
def test_calls_as_the_family_writes_them_run_and_answer_in_order(name, calls):
    call_text = resolve_format(name).render(calls)
    tokenizer, env, episode = play(name, [call_text, "It is 5."])
    # the policy's two turns are trained exactly as written, each with its stop token; nothing else
    assert trained_text(tokenizer, episode) == f"{call_text}<eos>It is 5.<eos>"
    assert [(c.name, c.arguments) for c in env.turns[0].calls] == [(c.name, c.arguments) for c in calls]
    context = tokenizer.decode([t for t, m in zip(episode.ids, episode.mask, strict=True) if not m])
    results = {"add": "5", "mul": "20", "search": "hits"}  # (Mistral's template writes results as JSON strings)
    positions = [context.index(results[c.name]) for c in calls]
    assert positions == sorted(positions)  # in call order, after the calls
    metrics = env.episode_metrics()
    assert metrics["tools/calls_per_episode"] == len(calls) and metrics["tools/malformed_fraction"] == 0.0
    assert episode.stop_reason == "done"


@pytest.mark.parametrize("name", FAMILIES)
def test_a_cut_call_and_malformed_json_are_answered_and_counted(name):
    whole = resolve_format(name).render(PARALLEL)
    broken = whole.replace('"b": 3', '"b": 3,,')
    cut = whole[: 3 * len(whole) // 4]  # inside the second call
    tokenizer, env, episode = play(name, [cut, broken, "It is 5."])
    context = tokenizer.decode([t for t, m in zip(episode.ids, episode.mask, strict=True) if not m])
    assert context.count("error: the tool call could not be read") == 2
    assert [turn.status for turn in env.turns] == ["malformed", "malformed", "no_call"]
    assert env.episode_metrics()["tools/malformed_fraction"] == pytest.approx(2 / 3)
    assert env.episode_metrics()["tools/calls_per_episode"] == 0.0


@pytest.mark.parametrize("name", FAMILIES)
def test_a_result_holding_the_formats_own_markers_changes_nothing_around_it(name):
    call = resolve_format(name).render([ToolCall("echo", {"text": MARKERS[name]}, "p1q2r3s4t")])
    tokenizer, env, episode = play(name, [call, "Done."])  # the prefix check holds at every turn
    assert trained_text(tokenizer, episode) == f"{call}<eos>Done.<eos>"
    assert [turn.status for turn in env.turns] == ["parsed", "no_call"]
    assert env.episode_metrics()["tools/calls_per_episode"] == 1.0  # the echoed "call" is not run


def test_a_template_that_drops_earlier_reasoning_is_refused_naming_the_turn():
    tokenizer, env = family("hermes")
    # as Qwen3's template does: an assistant turn before the last user turn loses its <think> block
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1] + '<|im_end|>\\n' }}",
    )
    call = "<think>add them</think>" + resolve_format("hermes").render(ONE)
    with pytest.raises(TemplatePrefixError, match="turn 1"):
        replay_actions(tokenizer, env, {"prompt": "What is 2 + 3?"}, [call, "It is 5."], EpisodeLimits(400))
