"""Prompt sources (registry ``PROMPT_SOURCES``) and synthetic task generators.

A prompt source is built as ``factory(tokenizer, seed, data_cfg)`` and offers ``max_prompt_len`` and
``next_prompts(count) -> list[list[int]]`` (token ids), deterministic for a seed. A source may also
offer ``next_batch(count) -> (prompts, answers)`` (reference answers for the reward function) and
``sample_budgets(count, max_new_tokens) -> list[int]`` (per-sample generation budgets).
"""

from asyncflow.data.sources import PROMPT_SOURCES, make_prompt_source, next_batch

__all__ = ["PROMPT_SOURCES", "make_prompt_source", "next_batch"]
