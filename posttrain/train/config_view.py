"""Configs you can read and compare: where each value of a resolved config comes from
(``--print-config``, ``--options`` given a config), and which values two configs differ in
(``posttrain diff``).

A config is made in layers — the package defaults, an algorithm preset (``rl``), the YAML file,
the command line's ``key=value`` overrides — each over the ones before. A value's origin is the
last layer that wrote its key (or a section holding it); a value no layer wrote is the default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from posttrain.config import ConfigError, deep_merge, parse_overrides, read_yaml, validate_config
from posttrain.errors import PosttrainError

DEFAULT = "default"


def config_class(command: str) -> type:
    """The config class of ``posttrain <command>``."""
    if command == "rl":
        from posttrain.train.rl_config import RLRun

        return RLRun
    from posttrain.train import recipes

    return {"sft": recipes.SFTRun, "rm": recipes.RewardModelRun, "dpo": recipes.DPORun}[command]


def config_layers(command: str, path: str | None, overrides: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """The named layers a command's config is merged from, lowest first (defaults excluded)."""
    if command == "rl":
        from posttrain.train.rl_config import rl_config_layers

        return rl_config_layers(path, list(overrides))
    layers = [(str(path), read_yaml(path))] if path is not None else []
    return [*layers, ("command line", parse_overrides(overrides))]


def layered_values(command: str, path: str | None, overrides: Sequence[str]) -> dict[str, tuple[Any, str]]:
    """Every leaf key some layer writes: (its value, the layer), without validating the whole
    (``--options algorithm=ppo`` shows a preset's values though no model or data is named)."""
    values: dict[str, tuple[Any, str]] = {}
    for name, layer in config_layers(command, path, overrides):
        values.update({key: (value, name) for key, value in flatten(layer).items()})
    return values


def resolved_with_origins(command: str, path: str | None, overrides: Sequence[str]) -> tuple[Any, dict[str, str]]:
    """The validated config and, for every leaf key of it (dotted), the layer it comes from."""
    layers = config_layers(command, path, overrides)
    merged: dict[str, Any] = {}
    for _, layer in layers:
        merged = deep_merge(merged, layer)
    config = validate_config(config_class(command), merged, source=str(path) if path else "the command line")
    origins = {key: _origin(key, layers) for key in flatten(config.model_dump(mode="json"))}
    return config, origins


def _origin(key: str, layers: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    for name, layer in reversed(layers):
        node: Any = layer
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
            if not isinstance(node, Mapping):  # a value written here, at the key or above it
                return name
        else:
            return name
    return DEFAULT


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1]}`` → ``{"a.b": 1, "c": [1]}`` (lists and empty sections are leaves)."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{key}."))
        else:
            flat[key] = value
    return flat


def shown(value: Any) -> str:
    """A value as YAML writes it inline (``null``, ``true``, ``[a, b]``, ``{r: 16}``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def print_config_lines(config: Any, origins: Mapping[str, str]) -> list[str]:
    """The resolved config as YAML, each value followed by ``# its origin``: it reads back as the
    same config."""
    lines: list[str] = []
    _render(config.model_dump(mode="json"), origins, "", 0, lines)
    width = max((len(text) for text, _ in lines), default=0) + 2
    return [f"{text:<{width}}# {origin}" if origin else text for text, origin in lines]


def _render(tree: Mapping[str, Any], origins: Mapping[str, str], prefix: str, depth: int, out: list) -> None:
    for name, value in tree.items():
        key, indent = f"{prefix}{name}", "  " * depth
        if isinstance(value, Mapping) and value:
            out.append((f"{indent}{name}:", ""))
            _render(value, origins, f"{key}.", depth + 1, out)
        else:
            out.append((f"{indent}{name}: {shown(value)}", origins.get(key, DEFAULT)))


def comparable(spec: str, command: str) -> tuple[str, dict[str, Any]]:
    """(what ``spec`` is, its resolved config flattened) for ``posttrain diff``: a run folder (its
    saved config.yaml), a YAML config file of ``command``, or an algorithm preset's name (rl)."""
    target = Path(spec)
    if target.is_dir():
        saved = target / "config.yaml"
        if not saved.is_file():
            raise PosttrainError(f"{target} holds no config.yaml: name a run folder, a config file or a preset")
        return f"run {target}", flatten(read_yaml(saved))
    if target.is_file():
        config, _ = resolved_with_origins(command, str(target), [])
        return f"{target} (as {command})", flatten(config.model_dump(mode="json"))
    from posttrain.train.rl_config import preset_names, preset_rollout, read_preset
    from posttrain.train.rl_sections import AlgorithmSection, RolloutSection

    if command == "rl" and spec in preset_names():  # the sections a preset sets, defaults filled in
        sections = {
            "algorithm": validate_config(AlgorithmSection, read_preset(spec), source=f"preset {spec}"),
            "rollout": validate_config(RolloutSection, preset_rollout(spec), source=f"preset {spec}"),
        }
        return f"preset {spec}", flatten({name: part.model_dump(mode="json") for name, part in sections.items()})
    presets = f" (presets: {', '.join(preset_names())})" if command == "rl" else ""
    raise PosttrainError(
        f"{spec!r} is not a run folder (one holding config.yaml), a config file or an algorithm preset{presets}"
    )


def differences(first: Mapping[str, Any], second: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, first's value, second's) for every leaf key whose values differ; a key one side lacks
    shows as absent. A preset (its algorithm and rollout sections) is compared with a whole
    config on those sections only."""
    missing = object()
    keys = list(first) + [key for key in second if key not in first]
    for side in (first, second):
        sections = {key.split(".")[0] for key in side}
        if sections <= {"algorithm", "rollout"}:
            keys = [key for key in keys if key.split(".")[0] in sections]
    rows = [(key, first.get(key, missing), second.get(key, missing)) for key in keys]
    return [
        (key, "(absent)" if a is missing else a, "(absent)" if b is missing else b)
        for key, a, b in rows
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str)
    ]


OPTIONS_WIDTH = 120  # columns of an --options line


def option_line(head: str, doc: str) -> str:
    """One ``--options`` row within :data:`OPTIONS_WIDTH` columns: the doc wrapped under itself (on
    the next line when the key and value take most of the width)."""
    import textwrap

    indent = min(len(head), 60)
    lines = textwrap.wrap(doc, width=OPTIONS_WIDTH - indent) or [""]
    first = head + lines[0] if len(head) <= indent else head.rstrip() + "\n" + " " * indent + lines[0]
    return "\n".join([first, *(" " * indent + line for line in lines[1:])]).rstrip()


EXAMPLE_CONFIG = {
    "rl": "configs/reverse_grpo.yaml",
    "sft": "configs/reverse_sft.yaml",
    "rm": "configs/preference_rm.yaml",
    "dpo": "configs/rlhf_dpo.yaml",
}
# the repository's config each training command can start from (what the README and docs run)
STARTING_CONFIG = {
    **EXAMPLE_CONFIG,
    "rl": f"{EXAMPLE_CONFIG['rl']}  (after make demo: its model.path is runs/demo/sft/final)",
    "dpo": f"{EXAMPLE_CONFIG['dpo']}  (after its SFT stage: docs/examples.md, RLHF)",
}


def load_or_say_where_to_start(command: str, config_file: str | None, load: Callable[[], Any]) -> Any:
    """The command's config; without a file, a config lacking its model or data says where to start."""
    try:
        return load()
    except ConfigError as error:
        if config_file is not None or not re.search(r"  - (model|data) is missing", str(error)):
            raise
        raise ConfigError(
            f"{error}\nStart from a config: posttrain {command} --config {STARTING_CONFIG[command]}; or name "
            "both: model.path=<a model folder or Hub id> (or model.tiny={}) and data.path=<a .jsonl file> (or "
            "data.task=reverse)"
        ) from None
