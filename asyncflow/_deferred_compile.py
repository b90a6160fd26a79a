"""Megatron-core's fusions compile on their first call, not at import.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and about forty fusion functions are decorated
with it when ``megatron.core`` is imported. ``torch.compile(fn)`` imports TorchInductor on the spot: about
2.7 CPU-seconds of the 7.2 that ``import megatron.core`` takes on a 2-core CPU machine, in every process
that imports Megatron (actor, reference, critic, each rank of a checkpoint conversion), whether or not it
ever calls a fused function (``models.megatron`` turns the fusions off on CPU). A trainer's optimizer still
imports TorchDynamo, not Inductor; a frozen reference imports neither.

``install()`` puts a finder on ``sys.meta_path`` that, once ``megatron.core.jit`` has executed, wraps its
``jit_fuser`` so that each decorated function is handed to the original fuser on its first call. The
compiled function, and so every result, is the one ``torch.compile`` gives; only when it is built changes.
``asyncflow/__init__.py`` installs it, so every process that imports asyncflow before Megatron has it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

TARGET = "megatron.core.jit"


def deferred(fuser):
    """A decorator that applies ``fuser`` to a function on the function's first call."""

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:  # a race compiles twice at worst; both results are the same function
                compiled = fuser(fn)
            return compiled(*args, **kwargs)

        call.deferred_fuser = fuser
        return call

    return decorate


class _WrapFuser(importlib.abc.Loader):
    """The real loader of ``megatron.core.jit``, then ``jit_fuser`` replaced by its deferred form."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        module.jit_fuser = deferred(module.jit_fuser)

    def __getattr__(self, name):  # get_source, get_filename, ... as the real loader has them
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrapFuser(spec.loader)
        return spec


def install() -> None:
    """Defer Megatron's fusion compiles in this process (idempotent; nothing when Megatron is imported)."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
