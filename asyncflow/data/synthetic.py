"""Synthetic tasks with verifiable answers that a tiny model learns in seconds (DEMO_TASK.md).

``add1``: the prompt is ``<bos> d1 d2 d3 d4 >`` and the answer is each digit plus one, mod 10
(``3648>`` -> ``4759``). The reward is the fraction of the four positions answered correctly.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Add1Task:
    """Prompt generation, reference answers and the reward of the add-one task, on token ids."""

    tokenizer: object
    num_digits: int = 4

    def __post_init__(self):
        tok = self.tokenizer
        self.digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.sep_id = tok.convert_tokens_to_ids(">")
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        if tok.unk_token_id in self.digit_ids + [self.sep_id]:
            raise ValueError("the tokenizer lacks digit or '>' tokens; use charset 'add1' or 'ascii'")
        self._id_to_digit = {t: d for d, t in enumerate(self.digit_ids)}

    def prompts(self, count: int, generator: torch.Generator | None = None) -> list[list[int]]:
        """``count`` random prompts as token ids."""
        digits = torch.randint(0, 10, (count, self.num_digits), generator=generator)
        return [[self.bos_id, *(self.digit_ids[d] for d in row.tolist()), self.sep_id] for row in digits]

    def answer(self, prompt: list[int]) -> list[int]:
        """The correct response tokens for ``prompt``."""
        digits = [self._id_to_digit[t] for t in prompt[1 : 1 + self.num_digits]]
        return [self.digit_ids[(d + 1) % 10] for d in digits]

    def reward(self, prompt: list[int], response: list[int], **info) -> float:
        """Fraction of answer positions that are right (an early ``<eos>`` scores the rest as wrong)."""
        want = self.answer(prompt)
        return sum(int(a == b) for a, b in zip(response, want)) / len(want)
