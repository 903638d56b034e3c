"""``posttrain view RUN_DIR``: a run's recorded rollouts as one self-contained HTML page.

Reads what ``record_rollouts`` wrote under ``RUN_DIR/rollouts/`` (``sources/recorded.py``): every
step's scored batch and, where the loop wrote it, what batch preparation added (advantages, the
loss mask, π_old). Each sample becomes a record the page (``view/rollout_page.py``) filters,
sorts and draws: its prompt, its tokens — the policy's and, between an episode's turns, the
environment's — each with its text, engine log-prob, engine−trainer gap, advantage, whether it was
trained on and the policy version that sampled it, the tool calls its turns made, its reward per
component, advantage, length and finish reason.

The page stays bounded whatever the run's length: at most :data:`MAX_STEPS` recorded steps and
about :data:`TOKEN_BUDGET` tokens go on it, chosen evenly over the run when there are more.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import PosttrainError
from posttrain.sources.recorded import read_batch, read_prepared, recorded_steps
from posttrain.telemetry.report import conversation_text, read_alarm
from posttrain.view.rollout_page import render_page

MAX_STEPS = 200
TOKEN_BUDGET = 400_000  # prompt and response tokens on one page (~40 MB of HTML at most)
VIEW_FILE = "rollouts.html"


class ViewError(PosttrainError, ValueError):
    """A folder ``posttrain view`` cannot show; the message says what to point it at."""


def write_view(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write the page over ``run_dir``'s recorded rollouts (default ``run_dir/rollouts.html``)."""
    run_dir = Path(run_dir)
    path = Path(output) if output is not None else run_dir / VIEW_FILE
    if not path.parent.is_dir():
        raise ViewError(f"--output {path}: the folder {path.parent} does not exist; create it or choose another path")
    if path.is_dir():
        raise ViewError(f"--output {path} is a folder: name the page's file, e.g. {path / VIEW_FILE}")
    path.write_text(render_page(view_data(run_dir)), encoding="utf-8")
    return path


def write_recorded_view(run_dir: Path) -> None:
    """The page a run draws over its folder at its end (``run_outputs.finish_run``'s ``pages``),
    when it recorded any rollouts: the report links it; ``posttrain view`` draws it again."""
    if (run_dir / "rollouts").is_dir():
        write_view(run_dir)


def view_data(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data."""
    folder = run_dir / "rollouts"
    steps = recorded_steps(folder) if folder.is_dir() else []
    if not steps:
        raise ViewError(
            f"{run_dir} holds no recorded rollouts ({folder} has no step): run with record_rollouts: auto (the "
            "default) or true, then view its output_dir"
        )
    config = _run_config(run_dir)
    tokenizer = _tokenizer(run_dir, config)
    formats = _tool_formats(config)
    shown = _steps_on_page(folder, steps)
    records = []
    texts: dict[int, str] = {}  # each token id's text, decoded once
    for step in shown:
        batch, _ = read_batch(folder, step)
        prepared = _prepared_rows(read_prepared(folder, step))
        widths, logprobs = batch.response_widths().tolist(), batch.engine_logprobs.tolist()
        for i in range(len(batch)):
            ids = batch.response_ids[i, : widths[i]].tolist()
            token_texts = _token_texts(tokenizer, ids, texts)
            records.append(_sample(batch, i, step, ids, token_texts, logprobs[i], formats, prepared))
    return {
        "run": run_dir.resolve().name,
        "alarm": read_alarm(run_dir),
        "components": _reward_names(config),
        "recorded_steps": len(steps),
        "steps": shown,
        "samples": records,
    }


def _steps_on_page(folder: Path, steps: list[int]) -> list[int]:
    """At most :data:`MAX_STEPS` steps, fewer when the first step's size says the token budget
    would be passed; spread evenly over the run, the first and last included."""
    first, _ = read_batch(folder, steps[0])
    per_step = int(first.prompt_mask.sum()) + int(first.response_attention_mask.sum())
    room = max(1, min(MAX_STEPS, TOKEN_BUDGET // max(per_step, 1)))
    if len(steps) <= room:
        return steps
    if room == 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (room - 1))] for i in range(room)})


def _sample(
    batch: Any,
    i: int,
    step: int,
    ids: list[int],
    texts: list[str],
    logprobs: list[float],
    formats: list,
    prepared: dict,
) -> dict[str, Any]:
    """One sample's record (see the module docstring): ``ids`` its response tokens up to the last
    attended one, ``texts`` theirs, ``logprobs`` its row of engine log-probs."""
    width = len(ids)
    sampled = batch.response_mask[i, :width].bool().tolist()
    versions = (batch.token_versions[i, :width].tolist() if batch.token_versions is not None
                else [int(batch.policy_version[i])] * width)  # fmt: skip
    annotation = prepared.get((int(batch.group_ids[i]), tuple(ids)), [None]).pop(0) if prepared else None
    tokens = []
    for t in range(width):
        token = {"text": texts[t], "sampled": sampled[t], "version": versions[t]}
        if sampled[t]:
            token["logprob"] = _finite(logprobs[t])
            if annotation is not None:
                token.update({name: values[t] for name, values in annotation.items() if name != "old"})
                if "old" in annotation:  # the engine's log-prob minus the trainer's π_old
                    token["gap"] = _finite(logprobs[t] - annotation["old"][t])
        tokens.append(token)
    score = float(batch.scores[i]) if batch.scores is not None else math.nan
    components = batch.reward_components[i].tolist() if batch.reward_components is not None else []
    trained = [t["advantage"] for t in tokens if t.get("trained") and t.get("advantage") is not None]
    return {
        "step": step,
        "group": int(batch.group_ids[i]),
        "prompt": str(conversation_text(batch.prompts[i])),
        "reward": None if math.isnan(score) else round(score, 5),
        "components": [None if math.isnan(c) else round(c, 5) for c in components],
        "error": math.isnan(score),
        "finish": "length" if bool(batch.truncated[i]) else "stop",
        "length": sum(sampled),
        "advantage": round(sum(trained) / len(trained), 5) if trained else None,
        "tokens": tokens,
        "calls": _tool_calls(tokens, formats),
    }


def _prepared_rows(tensors: dict | None) -> dict[tuple, list[dict[str, list]]]:
    """The prepared batch's per-token values by (group, response tokens): preparation may drop
    samples (no reward), so its rows are matched to the recorded ones by what they hold."""
    if not tensors or not _prepared_fields_fit(tensors):
        return {}  # a damaged annotation only costs the view its advantages
    rows: dict[tuple, list[dict[str, list]]] = {}
    mask = tensors["response_mask"]
    for j in range(mask.shape[0]):
        width = int(mask[j].nonzero().max()) + 1 if bool(mask[j].any()) else 0
        key = (int(tensors["group_ids"][j]), tuple(tensors["response_ids"][j, :width].tolist()))
        values: dict[str, list] = {}
        if "advantages" in tensors:
            values["advantage"] = [_finite(v) for v in tensors["advantages"][j, :width].tolist()]
        if "old_logprobs" in tensors:
            values["old"] = tensors["old_logprobs"][j, :width].tolist()
        if "loss_mask" in tensors:
            values["trained"] = [bool(v) for v in tensors["loss_mask"][j, :width].tolist()]
        rows.setdefault(key, []).append(values)
    return rows


def _prepared_fields_fit(tensors: dict) -> bool:
    """The prepared file holds the fields its rows are matched by, each [B] or [B, T] alike."""
    need = ("response_mask", "group_ids", "response_ids")
    if not all(name in tensors for name in need):
        return False
    mask = tensors["response_mask"]
    names = ("response_ids", "advantages", "old_logprobs", "loss_mask")
    per_token = [tensors[name] for name in names if name in tensors]
    return (
        mask.dim() == 2
        and tensors["group_ids"].shape == mask.shape[:1]
        and all(tensor.shape == mask.shape for tensor in per_token)
    )


def _finite(value: float) -> float | None:
    """``value`` rounded for the page, or None where it is not a number (JSON has no inf or NaN)."""
    return round(value, 5) if math.isfinite(value) else None


def _token_texts(tokenizer: Any, ids: list[int], known: dict[int, str]) -> list[str]:
    """Each token's own text (its id in angle brackets without a tokenizer); ``known`` caches them."""
    for i in set(ids) - known.keys():
        known[i] = f"<{i}>" if tokenizer is None else tokenizer.decode([i])
    return [known[i] for i in ids]


def _tool_calls(tokens: list[dict[str, Any]], formats: list[Any]) -> list[dict[str, Any]]:
    """The tool calls of each policy turn (a run of sampled tokens), parsed by the run's format."""
    from posttrain.envs.tool_formats import parse_turn

    calls, turn, turns = [], [], []
    for token in [*tokens, {"sampled": False}]:
        if token["sampled"]:
            turn.append(token["text"])
        elif turn:
            turns.append("".join(turn))
            turn = []
    for index, text in enumerate(turns):
        for tool_format in formats:
            parsed = parse_turn(tool_format, text)
            if parsed.status == "parsed":
                calls += [{"turn": index, "name": c.name, "arguments": c.arguments} for c in parsed.calls]
                break
            if parsed.status == "malformed":
                calls.append({"turn": index, "malformed": parsed.error})
                break
    return calls


def _run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, yaml.YAMLError):
        loaded = {}
    return loaded if isinstance(loaded, dict) else {}


def _tokenizer(run_dir: Path, config: dict[str, Any]) -> Any:
    """The run's tokenizer: its final model's, a checkpoint's, or its model folder's; None if none loads."""
    from posttrain.models.loading import load_tokenizer

    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: p.name, reverse=True)
    model = config.get("model")
    model_path = model.get("path") if isinstance(model, dict) and isinstance(model.get("path"), str) else None
    for folder in [run_dir / "final", *checkpoints, *([Path(model_path)] if model_path else [])]:
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            try:
                return load_tokenizer(folder)
            except PosttrainError:
                continue
    return None


def _tool_formats(config: dict[str, Any]) -> list[Any]:
    """The tool-call format of the run's environment (every built-in one for ``auto``); none
    without an environment (a completion calls no tool)."""
    from posttrain.envs.tool_formats import TOOL_FORMATS, resolve_format

    env = config.get("env")
    if not isinstance(env, dict):
        return []
    options = env.get("options") or {}
    named = options.get("format") if isinstance(options, dict) else None
    names = [named] if isinstance(named, str) and named in TOOL_FORMATS else list(TOOL_FORMATS)
    return [resolve_format(name) for name in names]


def _reward_names(config: dict[str, Any]) -> list[str]:
    """The reward functions' names, in the order of the recorded components."""
    names: list[str] = []
    rewards = config.get("rewards")
    for entry in rewards if isinstance(rewards, list) else []:
        if isinstance(entry, dict):
            entry = entry.get("name") or entry.get("function") or "reward"
        names.append(str(entry).split(":")[-1].split(".")[-1])
    return names
