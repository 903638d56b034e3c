"""The environment source reads a tool call whose marker is a special token — Mistral's
``[TOOL_CALLS]`` — in training batches and in evaluation alike (one decoding, ``Episode.add_turn``,
one parser): the episodes of both call the tool, get its result and end with the answer. Before,
each turn was decoded with special tokens skipped and every such call read as a final answer.

The policy is the real engine over a tiny model whose tokenizer has ``[TOOL_CALLS]`` as a special
token, made to write a scripted call then an answer (``ScriptedTurns``), as a trained policy would:
what is tested is what the source does with the tokens, not what a random model samples."""

from __future__ import annotations

import torch
from tokenizers import AddedToken

from posttrain.envs.section import EnvSection
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import DEFAULT_CHARSET, build_char_tokenizer
from posttrain.rollout.engine import build_engine
from posttrain.sources.environment import EnvironmentSource
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_sources import sampling_plan

CALL = '[{"name": "add", "arguments": {"a": 2, "b": 3}}]'


def add(a: int, b: int) -> int:
    return a + b


class ScriptedTurns:
    """The real engine, its sampled turns replaced by a script: the first turn of an episode calls
    ``add`` (``[TOOL_CALLS]`` as its token, then the JSON), a later one answers."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.call = [marker, *encode(CALL), tokenizer.eos_token_id]
        self.answer = [*encode("it is 5"), tokenizer.eos_token_id]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        rollouts = self.engine.generate(prompts, sampling)
        contexts = [prompt for prompt in prompts for _ in range(sampling.n)]
        scripted = [self.answer if self.call[0] in context else self.call for context in contexts]
        width = max(map(len, scripted))
        ids = torch.full((len(scripted), width), self.engine.pad_id, dtype=torch.long)
        for row, turn in enumerate(scripted):
            ids[row, : len(turn)] = torch.tensor(turn)
        lengths = torch.tensor(list(map(len, scripted)))
        rollouts.response_ids, rollouts.response_mask = ids, (torch.arange(width)[None] < lengths[:, None]).float()
        rollouts.logprobs = torch.zeros(len(scripted), width)
        return rollouts


def test_a_call_written_with_a_special_marker_is_a_call_in_training_and_in_evaluation():
    tokenizer = build_char_tokenizer(DEFAULT_CHARSET + '{}[]"')
    tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)], special_tokens=True)
    assert tokenizer.decode([tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")], skip_special_tokens=True) == ""
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    config = load_rl_config(None, ["model.tiny.layers=1", "data.task=reverse", "prompts_per_step=2",
                                   "samples_per_prompt=2", "max_new_tokens=64"])  # fmt: skip
    tools = {"tools": ["tests.sources.test_tool_marker_episodes:add"], "format": "mistral"}
    section = EnvSection(name="tools", options=tools, max_turns=3)
    engine = ScriptedTurns(build_engine(model, tokenizer), tokenizer)
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": "And 2 + 3?"}]
    source = EnvironmentSource(
        sampling_plan(config), section, engine, tokenizer, rows, None, context_limit=2048, echo=lambda s: None
    )
    batch, metrics = source.next_batch(1)
    evaluated = source.evaluate(rows)
    for figures in (metrics, {k.removeprefix("eval/"): v for k, v in evaluated.items()}):
        assert figures["tools/calls_per_episode"] == 1.0 and figures["tools/malformed_fraction"] == 0.0
        assert figures["turns_mean" if "turns_mean" in figures else "env/turns_mean"] == 2.0
    conversation = source.last_result[0]["conversation"]
    assert conversation[0] == {"role": "assistant", "content": "[TOOL_CALLS]" + CALL}
    assert conversation[1]["content"] == "5" and conversation[2]["content"] == "it is 5"
    assert all(c[1]["content"] == "5" for c in batch.completions)
