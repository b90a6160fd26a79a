"""The prompt-source registry and the built-in synthetic sources."""

from __future__ import annotations

import torch

from asyncflow.data.synthetic import Add1Task
from asyncflow.registry import Registry

PROMPT_SOURCES = Registry("prompt source")


@PROMPT_SOURCES.register("add1")
class Add1Prompts:
    """Endless random prompts of the add-one task (``<bos> d1 d2 d3 d4 >``)."""

    def __init__(self, tokenizer, seed: int = 0):
        self.task = Add1Task(tokenizer)
        self.generator = torch.Generator().manual_seed(seed)
        self.max_prompt_len = self.task.num_digits + 2

    def next_prompts(self, count: int) -> list[list[int]]:
        """The next ``count`` prompts of the stream."""
        return self.task.prompts(count, self.generator)


def make_prompt_source(spec: str, tokenizer, seed: int = 0):
    """Build prompt source ``spec`` (registered name or dotted path to a factory)."""
    return PROMPT_SOURCES.resolve(spec)(tokenizer, seed)
