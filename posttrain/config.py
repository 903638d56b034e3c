"""Typed configs: YAML files plus dotted command-line overrides, validated before any model loads.

Every config is a tree of :class:`Section` models (pydantic). An option is documented once,
in the docstring under its field; ``--help``, the docs and error messages all read it from
there. Loading merges ``defaults ← YAML file ← overrides`` and validates the result; any
problem raises :class:`ConfigError` listing *every* bad key at once, each with what was
expected, the valid choices and, for a misspelt key, the closest valid name.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from posttrain.errors import PosttrainError

ConfigT = TypeVar("ConfigT", bound="Section")


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading floats as YAML 1.2 does: ``1e-6`` and ``1.0e9`` are numbers.

    PyYAML follows YAML 1.1, where an exponent needs a dot and a sign, so ``1e-6`` loads as the
    string "1e-6": pydantic converts it for a typed field, but inside a free-form mapping such
    as ``algorithm.loss_options`` the string reached the loss and failed there mid-run.

    A key written twice in one mapping is an error: PyYAML keeps the last value silently, so a
    config with two ``model:`` sections ran with the second alone."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # PyYAML's own check names an unhashable key
            if key in seen:
                first, again = seen[key].start_mark.line + 1, key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} is written twice (lines {first} and {again}): keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


MAX_YAML_VALUES = 100_000  # a config holds hundreds; a data row's options a few thousand at most


def load_yaml(text: str) -> Any:
    """Parse YAML text as configs are parsed (safe, with YAML 1.2 exponent floats).

    Anchors and aliases (``&defaults`` / ``*defaults``, merge keys ``<<: *defaults``) are allowed,
    but the document's size with every alias expanded is counted before anything is built: eight
    nested levels of nine aliases each ("billion laughs") expand to 43 million values, which the
    checks after parsing would walk until memory ran out."""
    loader = YamlLoader(text)  # a SafeLoader subclass: no arbitrary objects
    try:
        return _load_node(loader)
    except RecursionError:  # PyYAML composes and builds nested values recursively: 20,000 levels
        raise yaml.YAMLError("the document nests values thousands of levels deep; a config never does") from None
    finally:
        loader.dispose()


def _load_node(loader: yaml.SafeLoader) -> Any:
    node = loader.get_single_node()
    if node is None:
        return None
    expanded = _expanded_size(node, {}, set())
    if expanded > MAX_YAML_VALUES:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"the document expands to more than {MAX_YAML_VALUES:,} values through its aliases (*name); "
            "a config is never that large, so it is not read",
            node.start_mark,
        )
    return loader.construct_document(node)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Values in ``node`` with aliases expanded, counting each shared node once per use (memoised,
    so a bomb costs its text's size to measure; stops counting past the cap)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:  # an alias to an enclosing node: infinitely large once expanded
        return MAX_YAML_VALUES + 1
    open_nodes.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = []
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_VALUES:
            break
    open_nodes.discard(key)
    sizes[key] = total
    return total


Beta = Annotated[float, Field(ge=0, lt=1)]
"""An Adam β: a decay rate in [0, 1)."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, options document themselves."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def with_default(section: type[Section], name: str, default: Any) -> Any:
    """The declaration of option ``name`` of ``section`` (its type's bounds and its documentation)
    with another default: a config made of a shared section changes a default without declaring
    the option twice (``steps: int = with_default(RunOptions, "steps", 200)``)."""
    return FieldInfo.merge_field_infos(section.model_fields[name], default=default)


class ConfigError(PosttrainError, ValueError):
    """One or more invalid config keys or values; the message names each one."""


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["model.path=out/sft", "rewards=[a, b]"]`` → a nested dict; values are parsed as YAML."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or error
            raise ConfigError(f"override {_shown(item)}: the value is not valid YAML ({problem})") from None
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {part!r}")
            node = child
        node[parts[-1]] = value
    return tree


def _shown(item: str, limit: int = 120) -> str:
    """An override as a message quotes it: the start of a huge one."""
    return repr(item) if len(item) <= limit else f"{item[:limit]!r}… ({len(item):,} characters)"


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``update`` wins, nested sections merge key by key, and an empty mapping
    (``algorithm.loss_options={}``) clears what the layers below set: ``{}`` means none."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and value and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, found a {type(data).__name__}")
    return data


def load_config(config_cls: type[ConfigT], path: str | Path | None = None, overrides: Sequence[str] = ()) -> ConfigT:
    """Defaults of ``config_cls`` ← the YAML file ← dotted overrides, validated as one."""
    raw = read_yaml(path) if path is not None else {}
    raw = deep_merge(raw, parse_overrides(overrides))
    return validate_config(config_cls, raw, source=str(path) if path else "the command line")


def validate_config(config_cls: type[ConfigT], raw: Mapping[str, Any], source: str = "config") -> ConfigT:
    try:
        return config_cls.model_validate(raw)
    except ValidationError as error:
        # a section's check across fields may report several problems, one per line
        problems = [line for item in error.errors() for line in _explain(config_cls, item).split("\n  - ")]
        listing = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"invalid config ({source}), {len(problems)} problem(s):\n{listing}") from None


def dump_config(config: Section) -> str:
    """The resolved config as YAML, for ``config.yaml`` in the run directory and checkpoints."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _explain(config_cls: type[Section], item: Mapping[str, Any]) -> str:
    loc = list(item["loc"])
    dotted = ".".join(str(part) for part in loc)
    if item["type"] == "extra_forbidden":
        parent = _section_at(config_cls, [str(p) for p in loc[:-1]])
        valid = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f" Did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
        return f"unknown key {dotted!r}; valid keys here: {', '.join(valid)}.{hint}"
    across_fields = item["type"] == "value_error" and isinstance(item.get("input"), Mapping)
    if not loc or across_fields:  # a section's own check; its message names the fields
        return str(item["msg"]).removeprefix("Value error, ")
    if item["type"] == "missing":  # say what the key is, from its own documentation
        parent = _section_at(config_cls, [str(p) for p in loc[:-1]])
        field = parent.model_fields.get(str(loc[-1])) if parent else None
        meaning = (field.description or "").split("\n")[0].strip() if field else ""
        return f"{dotted} is missing" + (f": {meaning}" if meaning else "")
    value = item.get("input")
    shown = repr(value) if not isinstance(value, Mapping) else "a mapping"
    return f"{dotted} = {shown}: {item['msg']}"


def _section_at(config_cls: type[Section], path: list[str]) -> type[Section] | None:
    """The Section class reached by following field names (through Optional/Union)."""
    current: type[Section] | None = config_cls
    for name in path:
        if current is None or name not in current.model_fields:
            return None
        current = _section_type(current.model_fields[name].annotation)
    return current


def _section_type(annotation: Any) -> type[Section] | None:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_type(arg)
            if found is not None:
                return found
    return None


def describe(config_cls: type[Section], prefix: str = "") -> list[tuple[str, str, str]]:
    """Every option as ``(dotted key, default, docstring)``, nested sections flattened."""
    rows: list[tuple[str, str, str]] = []
    for name, field in config_cls.model_fields.items():
        key = f"{prefix}{name}"
        nested = _section_type(field.annotation)
        if nested is not None:
            rows.extend(describe(nested, prefix=f"{key}."))
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((key, default, " ".join((field.description or "").split())))
    return rows
