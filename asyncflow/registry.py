"""Small name -> object registries for extension points, and dotted-path loading for user code.

``Registry("reward function")`` gives a decorator ``@REG.register("name")``; ``REG.get(name)`` returns
the object or raises an error that lists the valid names. ``REG.resolve(spec)`` accepts either a
registered name or ``package.module:attr`` / ``package.module.attr`` for code outside the repository.

Built-ins that live in a higher layer than their registry (the Megatron and vLLM engines, the calculator
agent loop) are named by dotted path, ``Registry("train engine", builtins={"megatron": "pkg.mod:Class"})``,
and imported on first use: a registry never imports its implementations to fill itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class RegistryError(KeyError):
    """An unknown name (the message lists the valid ones) or a dotted path that does not import."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def load_object(path: str) -> Any:
    """Import ``pkg.mod:attr`` or ``pkg.mod.attr``."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise RegistryError(f"{path!r} is not a dotted path (package.module:attribute)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise RegistryError(f"{module_name!r} has no attribute {attr!r}") from exc


class Registry:
    """A named collection of extension objects (classes or functions)."""

    def __init__(self, kind: str, builtins: dict[str, str] | None = None):
        """``builtins``: name -> dotted path of entries imported when first resolved."""
        self.kind = kind
        self._items: dict[str, Any] = {}
        self._lazy: dict[str, str] = dict(builtins or {})

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator that registers its target under ``name`` (a name may be registered once)."""

        def wrap(obj: Any) -> Any:
            lazy = self._lazy.get(name)
            if lazy is not None and lazy == f"{obj.__module__}:{obj.__qualname__}":
                del self._lazy[name]  # the built-in's own module registering it as well
            if (name in self._items and self._items[name] is not obj) or name in self._lazy:
                raise RegistryError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return wrap

    def get(self, name: str) -> Any:
        """The object registered as ``name``."""
        if name in self._lazy:
            obj = load_object(self._lazy[name])
            self._lazy.pop(name, None)  # gone already if the module registered it itself
            self._items[name] = obj
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(self.names()) or "(none)"
            raise RegistryError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def resolve(self, spec: str) -> Any:
        """A registered name, or a dotted path to user code."""
        if spec in self._items or spec in self._lazy:
            return self.get(spec)
        if "." in spec or ":" in spec:
            return load_object(spec)
        return self.get(spec)

    def names(self) -> list[str]:
        """Registered names (built-ins not imported yet included), sorted."""
        return sorted({*self._items, *self._lazy})

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._lazy
