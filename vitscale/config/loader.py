"""YAML pipeline files -> typed, validated `PipelineConfig`.

This layer knows no stage: the registry (`vitscale.stages`) hands it the section classes.
Precedence is CLI > file > defaults: the file's mapping is applied over the dataclass defaults,
then each `--set dotted.key=value` override (its value parsed as YAML, so `4e-4`, `true`, `[1, 5]`
and `null` mean what they look like). Any unknown key, wrong type or impossible value raises
`ConfigError` naming the dotted key and the file before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from vitscale.config.checks import ConfigError, one_of
from vitscale.config.fields import is_path, overridden
from vitscale.config.location import canonical_location
from vitscale.config.pipeline import PipelineConfig
from vitscale.config.suggest import did_you_mean

INT64_MAX = 2**63 - 1
"""The largest integer a setting may hold."""


class _UniqueKeys(yaml.SafeLoader):
    """`yaml.safe_load`, except that a key written twice in one mapping is an error. PyYAML keeps the last
    one silently: a second `train:` section would drop every setting of the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` lays a mapping under this one's own keys: that is no repeat
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found key {key!r} twice in one mapping (only the last would count): keep one",
                    key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """YAML text as plain data, as `yaml.safe_load` reads it but refusing a key given twice in a mapping."""
    return yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader: plain data only


def _read_mapping(path: Path, _seen: frozenset) -> dict[str, Any]:
    """The YAML mapping of one pipeline file, with any `extends:` base merged underneath it."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read pipeline file: {exc.strerror}", source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError("<file>", f"is not UTF-8 text (byte {exc.start}): a pipeline file is YAML, save it as "
                                    "UTF-8", source) from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"is not valid YAML: {exc}", source) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("<file>", f"must be a mapping of stage names to settings, got {type(raw).__name__}",
                          source)
    if "extends" in raw:
        # A recipe names the pipeline it refines (path relative to the recipe) and lists only what differs.
        base = raw.pop("extends")
        if not isinstance(base, str):
            raise ConfigError("extends", f"must be a path to another pipeline file, got {base!r}", source)
        if len(_seen) > 8 or (path.parent / base).resolve() in _seen:
            raise ConfigError("extends", "forms a cycle or is nested too deep", source)
        raw = merge(_read_mapping(path.parent / base, _seen | {path.resolve()}), raw)
    return raw


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` laid over `base`, section by section (a mapping in `top` refines the one in `base`)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_pipeline(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The plain mapping of a pipeline YAML file (following `extends:`) with `key=value` overrides applied."""
    path = Path(path)
    raw = _read_mapping(path, frozenset())
    for item in overrides:
        raw = apply_override(raw, item)
    return raw


def build_pipeline(raw: dict[str, Any], *, sections: Mapping[str, type], stage_names: Collection[str],
                   source: str | None = None) -> PipelineConfig:
    """Turn a plain mapping (parsed YAML) into a validated `PipelineConfig`.

    `sections` maps each section name to its frozen config class and `stage_names` are the stages
    that exist: both come from the stage registry (`vitscale.stages`), so this layer knows no stage.
    Every section is built (defaults where `raw` is silent) and validated by its own `validate()`.
    """
    try:
        raw = dict(raw)
        top = {k: raw.pop(k) for k in ("name", "stages", "cluster") if k in raw}
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            known = ", ".join(["name", "stages", "cluster", *sorted(sections)])
            hint = did_you_mean(unknown[0], ["name", "stages", "cluster", *sections])
            raise ConfigError(unknown[0], f"unknown key{hint}; "
                              f"the top level accepts: {known}")
        config = _build(PipelineConfig, top, "")
        for stage in config.stages:
            one_of(stage, tuple(stage_names), "stages")
        built = {name: build_section(cls, raw.get(name, {}), name) for name, cls in sections.items()}
        config = replace(config, sections=built, source=source)
        config.validate()
    except ConfigError as exc:
        raise exc.in_file(source) if source else exc from None
    return config


def build_section(cls: type, raw: Any, name: str) -> Any:
    """One config section from its mapping, validated (`ConfigError` naming `name.key`)."""
    section = _build(cls, {} if raw is None else raw, f"{name}.")
    validate = getattr(section, "validate", None)
    if validate is not None:
        validate()
    return section


def absolute_paths(config: PipelineConfig) -> PipelineConfig:
    """Local paths made absolute (fields marked `metadata={"path": True}`), on the driver.

    Ray workers run in a directory of their own, so a relative `data.url` must be resolved where
    the user typed it. Every location takes its one spelling (`canonical_location`: URLs too, and a
    malformed one is refused); empty values are left alone.
    """

    def absolute(url: str, key: str) -> str:
        return canonical_location(url, key) if url else url

    def fixed(value: Any, key: str) -> Any:
        if isinstance(value, str):
            return absolute(value, key)
        return tuple(absolute(v, key) for v in value) if isinstance(value, tuple) else value

    def fix_overrides(cls: type, values: dict[str, Any], key: str) -> dict[str, Any]:
        paths = {f.name for f in dataclasses.fields(cls) if is_path(f.metadata)}
        return {k: fixed(v, f"{key}.{k}") if k in paths else v for k, v in values.items()}

    def fix(section: Any, name: str) -> Any:
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            target = overridden(f.metadata)
            if is_path(f.metadata):
                changes[f.name] = fixed(value, f"{name}.{f.name}")
            elif target is not None and isinstance(value, dict):
                changes[f.name] = fix_overrides(target, value, f"{name}.{f.name}")
        return replace(section, **changes) if changes else section

    sections = {name: fix(s, name) if dataclasses.is_dataclass(s) else s for name, s in config.sections.items()}
    return replace(config, cluster=fix(config.cluster, "cluster"), sections=sections)


def apply_override(raw: dict[str, Any], item: str) -> dict[str, Any]:
    """Return a copy of `raw` with one `dotted.key=value` override applied (value parsed as YAML)."""
    key, equals, text = item.partition("=")
    key = key.strip()
    if not equals or not all(part.strip() for part in key.split(".")):  # `train`, `=5`, `train.=5`, `a..b=1`
        raise ConfigError(key or item, "an override must look like dotted.key=value (e.g. train.base_lr=4e-4)",
                          "--set")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {text!r}: {exc}", "--set") from None
    out = json.loads(json.dumps(raw))  # deep copy of plain YAML data
    node = out
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: depth + 1]), "is not a section, cannot set a key inside it",
                              "--set")
        node = child
    node[parts[-1]] = value
    return out


def to_dict(config: Any) -> Any:
    """A config as plain data (tuples as lists), for YAML/JSON output and run directories.

    A pipeline is flattened to its YAML shape (sections at the top level); a section that is
    written differently from its fields (the model: name, img_size and the model's own keyword
    arguments) says how through `to_mapping()`.
    """
    if isinstance(config, PipelineConfig):
        out = {"name": config.name, "stages": list(config.stages), "cluster": to_dict(config.cluster)}
        out.update({name: to_dict(section) for name, section in config.sections.items()})
        return out
    if hasattr(config, "to_mapping"):
        return json.loads(json.dumps(config.to_mapping()))
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    return config


def to_yaml(config: Any) -> str:
    """The resolved config as YAML: what `vitscale config` prints and run directories keep."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "<file>", f"must be a mapping, got {_describe(raw)}")
    if hasattr(cls, "from_mapping"):
        # A section whose keys are someone else's keyword arguments (the model's) parses itself.
        return cls.from_mapping(raw, prefix.rstrip("."))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _refuse_moved(cls, raw, prefix)
    _refuse_unknown(fields, raw, prefix)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        target = overridden(fields[name].metadata)
        kwargs[name] = (_overrides(target, value, f"{prefix}{name}") if target is not None
                        else _field_value(fields[name], hints[name], value, f"{prefix}{name}"))
    return cls(**kwargs)


def _field_value(field: dataclasses.Field, tp: Any, value: Any, key: str) -> Any:
    """`value` checked against the field's annotation; a path field's (fields.PATH) must also be text naming
    something: a number there (`storage_path: 0`) or a blank one is a slip, not a folder anyone means."""
    if is_path(field.metadata) and value is not None:
        listed = isinstance(value, (list, tuple))
        for i, item in enumerate(value if listed else [value]):
            where = f"{key}[{i}]" if listed else key
            if not isinstance(item, str):
                number = isinstance(item, (int, float)) and not isinstance(item, bool)
                quote = f" (write '{item}' in quotes if a folder has that name)" if number else ""
                raise ConfigError(where, f"expected a path or URL, got {_describe(item)}{quote}")
            if not item.strip():
                raise ConfigError(where, f"expected a path or URL, got {item!r}")
    return _coerce(tp, value, key)


def _refuse_moved(cls: type, raw: dict[str, Any], prefix: str) -> None:
    """A key a section's `MOVED` table lists (an older shape of the section): one line saying where each went."""
    moved: Mapping[str, str] = getattr(cls, "MOVED", {})
    old = [key for key in raw if key in moved]
    if old:
        where = "; ".join(f"{prefix}{key} moved to {prefix}{moved[key]}" for key in old)
        section = prefix.rstrip(".")
        raise ConfigError(f"{prefix}{old[0]}", f"is from an older shape of {section}: {where} "
                                               f"(docs/{section.split('.')[0]}.md)")


def _refuse_unknown(fields: Mapping[str, Any], raw: Mapping[str, Any], prefix: str) -> None:
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        known = ", ".join(sorted(fields))
        raise ConfigError(key, f"unknown key{did_you_mean(unknown[0], fields)}; "
                              f"{prefix.rstrip('.') or 'the top level'} accepts: {known}")


def _overrides(cls: type, raw: Any, key: str) -> dict[str, Any]:
    """A mapping of some of `cls`'s fields, each checked against its annotation (field metadata
    `overrides(cls)`); the owner lays it over its own defaults and validates the result."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(key, f"must be a mapping of {cls.__name__} keys, got {_describe(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _refuse_unknown(fields, raw, f"{key}.")
    hints = typing.get_type_hints(cls)
    return {name: _field_value(fields[name], hints[name], value, f"{key}.{name}") for name, value in raw.items()}


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where it is lossless."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(key, "must not be null")
        kinds = [option for option in options if option is not type(None)]
        if len(kinds) == 1:  # `int | None`: the int's own complaint ("out of range"), not "expected int, got int"
            return _coerce(kinds[0], value, key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]  # a scalar where a list is expected: `shots: 5` means (5,)
        (item_type, *_rest) = typing.get_args(tp)
        return tuple(_coerce(item_type, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {_describe(value)}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(key_type, k, f"{key}"): _coerce(value_type, v, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {_describe(value)}")
        if not -INT64_MAX - 1 <= value <= INT64_MAX:  # torch, numpy, Ray and Arrow hold no bigger integer
            digits = str(abs(value))
            raise ConfigError(key, f"an integer of {len(digits)} digits is out of range (at most {INT64_MAX:,})")
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads "1e-3" (no dot) as a string; accept it as the number it means.
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
        if finite and not isinstance(value, bool):
            return str(value)  # e.g. peak_flops: 9.89e14 (YAML's .nan and .inf are no one's text)
        raise ConfigError(key, f"expected a string, got {_describe(value)}")
    raise ConfigError(key, f"unsupported annotation {tp!r}")  # a bug in schema.py, not user input


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "null"


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in args]
    return " or ".join(names) + (" or null" if len(args) < len(typing.get_args(tp)) else "")
