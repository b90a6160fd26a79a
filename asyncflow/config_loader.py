"""Typed config loading: YAML files and dotted command-line overrides into nested dataclasses.

Written by hand (about 150 lines) rather than with OmegaConf or dacite because both report an unknown
key without listing the valid ones, and that listing is the error users need. Defaults live only in
the dataclasses; a YAML file holds overrides; ``a.b.c=value`` on the command line overrides the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config key that does not exist, or a value of the wrong type, named by its dotted path."""


class ConfigSyntaxError(ConfigError):
    """A config file that is not valid YAML; the message starts with ``file:line:column:``, as compilers write it,
    so that editors jump to the spot."""


def _read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; a syntax error becomes a ``ConfigSyntaxError`` naming the file and the spot."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        # problem_mark is where the parser gave up; context is what it was inside (e.g. "a flow sequence").
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = exc.problem or "not valid YAML"
        if exc.context:
            opened = exc.context_mark
            at = f" at {opened.line + 1}:{opened.column + 1}" if opened is not None and opened is not mark else ""
            what = f"{what} ({exc.context}{at})"
        if "'\\t'" in what:
            what += "; YAML indents with spaces, not tabs"
        raise ConfigSyntaxError(f"{where}: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigSyntaxError(f"{path}: not valid YAML ({exc})") from None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` checked (and minimally converted) against the annotation ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message (say, the valid Literal values) is the useful one
            return _coerce(value, options[0], key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return build(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool (true/false), got {value!r}")
    if tp is float:
        # YAML 1.1 reads "1e-6" as a string; accept it, and ints, for float fields.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected float, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected str, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (possibly partial) nested dict; missing keys keep their defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            valid = ", ".join(sorted(fields))
            where = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"unknown config key '{key}'; valid keys in {where}: {valid}")
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from exc


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ``["trainer.lr=1e-6", "rollout.n=4"]`` into a nested dict (values parsed as YAML scalars)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override '{item}' has an empty key part")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return nested


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge ``top`` into a copy of ``base``; nested mappings merge, anything else is replaced."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load(cls: type, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Load dataclass ``cls`` from an optional YAML file plus dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir() and (path / "config.yaml").is_file():  # `plan` and `simulate` take a recipe folder
            raise ConfigError(f"{path} is a recipe folder; give its config file: {path / 'config.yaml'}")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = _read_yaml(path) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded
    data = deep_merge(data, parse_overrides(list(overrides)))
    return build(cls, data)


SECRET_KEYS = frozenset({"secret", "password", "token", "api_key"})
"""Config keys whose values never leave the process in dumps, logs or metrics sinks."""

REDACTED = "<redacted>"


def redact_secrets(data: Any) -> Any:
    """A copy of plain config data with the value of every key in ``SECRET_KEYS`` replaced (when set)."""
    if isinstance(data, Mapping):
        return {k: (REDACTED if k in SECRET_KEYS and v is not None else redact_secrets(v))
                for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(redact_secrets(v) for v in data)
    return data


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (for printing, YAML dumps and metrics), secrets redacted:
    everything this returns may end up in a terminal, a log or a wandb run."""
    return redact_secrets(dataclasses.asdict(cfg))


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML text (secrets redacted)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
