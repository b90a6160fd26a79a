"""Runtime patches that let Megatron-core train on CPU with gloo.

``megatron_patches.apply()`` is idempotent and does nothing on a machine where CUDA is available.
Each concern lives in its own file whose header names the target, the reason and the Megatron versions
it was checked on; ``TARGETS`` in each file lists what it patches or relies on, and
``missing_targets()`` reports any that the installed Megatron lacks (a test asserts there are none).
"""

from __future__ import annotations

import importlib.metadata

import torch

from . import device, mixed_precision, moe, optimizer, pipeline, recompute, rng
from ._util import resolve

SUPPORTED_MEGATRON = ("0.16",)
"""Megatron-core release lines (major.minor) these patches were checked on."""

PATCHES = (device, rng, pipeline, optimizer, mixed_precision, moe, recompute)


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not one these patches were written for."""


def megatron_version() -> str:
    """The installed megatron-core version, or raise a clear error when it is missing."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise UnsupportedMegatronVersion(
            "megatron-core is not installed; install the CPU stack with `make venv` "
            "(megatron-core 0.16.1) or `pip install -e .[gpu]` on a cluster"
        ) from exc


def check_version(version: str | None = None) -> str:
    """Raise ``UnsupportedMegatronVersion`` unless ``version`` (default: installed) is supported."""
    version = version or megatron_version()
    if not any(version == line or version.startswith(line + ".") for line in SUPPORTED_MEGATRON):
        supported = ", ".join(f"{line}.x" for line in SUPPORTED_MEGATRON)
        raise UnsupportedMegatronVersion(
            f"megatron_patches supports megatron-core {supported}; found {version}. "
            "Pin megatron-core==0.16.1 (requirements/cpu-constraints.txt) or run on CUDA, "
            "where no patch is needed."
        )
    return version


def missing_targets() -> list[str]:
    """Dotted names listed in some patch's TARGETS that do not resolve in the installed stack."""
    missing = []
    for patch in PATCHES:
        for target in patch.TARGETS:
            try:
                resolve(target)
            except (ImportError, AttributeError):
                missing.append(f"{patch.__name__}: {target}")
    return missing


def apply(force: bool = False) -> bool:
    """Make Megatron-core run on CPU. Returns True when patches are active in this process.

    On a CUDA machine this changes nothing (unless ``force``, used by tests). Safe to call many times
    and from several threads; call it in every thread that runs Megatron code (see ``device.py``).
    """
    if torch.cuda.is_available() and not force:
        return False
    check_version()
    for patch in PATCHES:
        patch.apply()
    return True
