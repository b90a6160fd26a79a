"""AsyncFlow: asynchronous streaming RL post-training on Megatron-core and vLLM."""

from asyncflow import _deferred_compile

_deferred_compile.install()  # before anything imports Megatron: see the module's docstring
