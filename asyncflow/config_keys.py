"""``asyncflow config keys [SECTION]``: every config key with its type, default and the docstring under its field.

The docstrings are read from the dataclasses' source (a string literal right after a field is its documentation,
as in torchtitan's configs), so the listing and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Literal, Union

from asyncflow.config import AsyncFlowConfig
from asyncflow.config_loader import ConfigError

__all__ = ["Key", "field_docs", "keys", "render"]


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key as ``config keys`` lists it."""

    name: str
    """Dotted path (``trainer.lr``)."""
    type: str
    """The annotation as text (``float``, ``str | None``, ``'shortest' | 'arrival'``)."""
    default: str
    """The default as YAML would write it."""
    doc: str
    """The docstring under the field (empty when it has none)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, over ``cls`` and its dataclass bases (a subclass's wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _default_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" or value != value.strip() else value
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def keys(cls: type = AsyncFlowConfig, prefix: str = "") -> list[Key]:
    """Every leaf key of the dataclass ``cls`` (nested sections flattened to dotted names), in field order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    found = []
    for f in dataclasses.fields(cls):
        name, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            found += keys(tp, f"{name}.")
            continue
        default = _default(f)
        text = "(required)" if default is dataclasses.MISSING else _default_text(default)
        found.append(Key(name, _type_text(tp), text, docs.get(f.name, "")))
    return found


def _section_type(section: str) -> type:
    hints = typing.get_type_hints(AsyncFlowConfig)
    sections = [f.name for f in dataclasses.fields(AsyncFlowConfig) if dataclasses.is_dataclass(hints[f.name])]
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}'; sections: {', '.join(sections)}")
    return hints[section]


def render(section: str | None = None, width: int = 116) -> str:
    """The listing of one section (or all of them): ``name: type = default`` lines, each with its docstring
    below, indented; a section starts with its class name and docstring."""
    hints = typing.get_type_hints(AsyncFlowConfig)
    names = [section] if section else [f.name for f in dataclasses.fields(AsyncFlowConfig)]
    lines: list[str] = []
    for name in names:
        cls = _section_type(name) if section else hints[name]
        doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        lines += [f"# {name} ({cls.__name__})", *textwrap.wrap(doc, width, initial_indent="# ",
                                                               subsequent_indent="# ")]
        for key in keys(cls, f"{name}."):
            lines.append(f"{key.name}: {key.type} = {key.default}")
            for paragraph in key.doc.split("\n\n"):
                lines += textwrap.wrap(" ".join(paragraph.split()), width, initial_indent="    ",
                                       subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines)
