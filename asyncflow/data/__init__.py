"""Prompt sources (registry ``PROMPT_SOURCES``) and synthetic task generators.

A prompt source is built as ``factory(tokenizer, seed, data_cfg)`` and offers ``max_prompt_len`` and
``next_prompts(count) -> list[list[int]]`` (token ids), deterministic for a seed. A source may also
offer ``next_batch(count) -> (prompts, answers)`` (reference answers for the reward function) and
``sample_budgets(count, max_new_tokens) -> list[int]`` (per-sample generation budgets).
"""

import importlib

__all__ = ["PROMPT_SOURCES", "make_prompt_source", "next_batch"]


def __getattr__(name: str):
    # The sources import torch: ``asyncflow.config`` (which reads ``asyncflow.data.config``) and the processes that
    # only read the config, such as the version board's, must not pay for it.
    if name in __all__:
        return getattr(importlib.import_module("asyncflow.data.sources"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
