"""AsyncFlow: asynchronous streaming RL post-training on Megatron-core and vLLM."""

from asyncflow import _deferred_compile

_deferred_compile.install()  # before anything imports Megatron: see the module's docstring


def __getattr__(name: str):
    """``asyncflow.train`` (``asyncflow.api.train``), imported on first use: ``import asyncflow`` stays light."""
    if name in ("train", "build_config"):
        from asyncflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'asyncflow' has no attribute {name!r}")
