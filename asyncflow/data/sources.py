"""The prompt-source registry and the built-in synthetic sources (the file sources, ``jsonl`` and ``parquet``,
live in ``asyncflow.data.datasets`` and are imported when first asked for)."""

from __future__ import annotations

import torch

from asyncflow.data.synthetic import Add1Task, CalcTask
from asyncflow.registry import Registry

PROMPT_SOURCES = Registry("prompt source", builtins={
    "jsonl": "asyncflow.data.datasets:jsonl_prompts",
    "parquet": "asyncflow.data.datasets:parquet_prompts",
})


class SyntheticPrompts:
    """Endless random prompts of a synthetic task (``task.prompts(count, generator)``); subclasses set
    ``self.task`` and ``self.max_prompt_len``. Its position is its random generator's state."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def next_prompts(self, count: int) -> list[list[int]]:
        """The next ``count`` prompts of the stream."""
        return self.task.prompts(count, self.generator)

    def state_dict(self) -> dict:
        """The stream's position (its random generator's state), as plain JSON data for checkpoints."""
        return {"generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream from a position saved by :meth:`state_dict`."""
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


@PROMPT_SOURCES.register("add1")
class Add1Prompts(SyntheticPrompts):
    """Endless random prompts of the add-one task (``<bos> d1 d2 d3 d4 >``)."""

    def __init__(self, tokenizer, seed: int = 0, data_cfg=None):
        super().__init__(seed)
        self.task = Add1Task(tokenizer)
        self.max_prompt_len = self.task.num_digits + 2


@PROMPT_SOURCES.register("add1_longtail")
class Add1LongTail(Add1Prompts):
    """Add-one prompts whose responses get long-tailed length budgets (a lognormal clipped to
    ``[4, max_new_tokens]``), as reasoning rollouts have: most are short, a few are very long. For
    throughput benchmarks; the reward still scores the first four tokens."""

    def __init__(self, tokenizer, seed: int = 0, data_cfg=None, median: float = 24.0, sigma: float = 1.0):
        super().__init__(tokenizer, seed)
        self.median, self.sigma = median, sigma

    def sample_budgets(self, count: int, max_new_tokens: int) -> list[int]:
        """Per-sample generation budgets."""
        normal = torch.randn(count, generator=self.generator)
        budgets = torch.exp(torch.log(torch.tensor(self.median)) + self.sigma * normal)
        return budgets.clamp(4, max_new_tokens).round().long().tolist()


@PROMPT_SOURCES.register("add1_heavytail")
class Add1HeavyTail(Add1LongTail):
    """Add-one prompts with heavier-tailed budgets (median 8 tokens, sigma 1.5): with ``max_new_tokens`` 248 the
    longest response of a step is 10-12x the mean, as in published reasoning workloads."""

    def __init__(self, tokenizer, seed: int = 0, data_cfg=None):
        super().__init__(tokenizer, seed, median=8.0, sigma=1.5)


@PROMPT_SOURCES.register("calc")
class CalcPrompts(SyntheticPrompts):
    """Endless random two-digit multiplication prompts of the ``calc`` tool task."""

    def __init__(self, tokenizer, seed: int = 0, data_cfg=None):
        super().__init__(seed)
        self.task = CalcTask(tokenizer)
        self.max_prompt_len = self.task.max_prompt_len


def make_prompt_source(spec: str, tokenizer, seed: int = 0, data_cfg=None):
    """Build prompt source ``spec`` (registered name or dotted path to ``factory(tokenizer, seed, data_cfg)``)."""
    return PROMPT_SOURCES.resolve(spec)(tokenizer, seed, data_cfg)


def next_batch(source, count: int) -> tuple[list[list[int]], list | None]:
    """``count`` prompts and their reference answers (None when the source has no answers)."""
    if hasattr(source, "next_batch"):
        return source.next_batch(count)
    return source.next_prompts(count), None
