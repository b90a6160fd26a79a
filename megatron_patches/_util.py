"""Helpers shared by the patch files: resolve dotted targets and record what each patch replaced."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(dotted: str) -> Any:
    """Return the object named by ``pkg.module.Attr.attr``; raise AttributeError/ImportError if absent."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import any prefix of {dotted}")


def replace(dotted: str, new: Any) -> Any:
    """Set the attribute named by ``dotted`` to ``new`` and return the original."""
    owner_path, attr = dotted.rsplit(".", 1)
    owner = resolve(owner_path)
    original = getattr(owner, attr)
    setattr(owner, attr, new)
    return original
