"""Prompt sources (registry ``PROMPT_SOURCES``) and synthetic task generators.

A prompt source is built as ``factory(tokenizer, seed)`` and offers ``max_prompt_len`` and
``next_prompts(count) -> list[list[int]]`` (token ids), deterministic for a seed. A source may also
offer ``sample_budgets(count, max_new_tokens) -> list[int]``: per-sample generation budgets.
"""

from asyncflow.data.sources import PROMPT_SOURCES, make_prompt_source

__all__ = ["PROMPT_SOURCES", "make_prompt_source"]
