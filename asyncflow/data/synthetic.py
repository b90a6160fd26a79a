"""Synthetic tasks with verifiable answers that a tiny model learns in seconds (DEMO_TASK.md).

``add1``: the prompt is ``<bos> d1 d2 d3 d4 >`` and the answer is each digit plus one, mod 10
(``3648>`` -> ``4759``). The reward is the fraction of the four positions answered correctly.

``calc``, the built-in tool task (``workflow.task: calc``, ``algorithm.reward: calc``, ``agent.loop:
calculator``): the prompt is ``<bos> a1 a2 , b1 b2 >`` and the answer is the product as four digits
(``37,48>`` -> ``1776``). Doing that token by token is beyond a tiny model, but it may call the calculator
by emitting ``:``; the agent loop (``asyncflow.agents.calculator``) then appends the product and ``=``
(``:1776=``), and the model answers after it: copying four digits at a fixed offset is what the tiny model
learns on ``add1``. The reward scores the four tokens after the calculator's output, 0 when the response
holds none: were answers without a tool call scored, the model would learn to guess digit statistics and
call the tool less and less, and the copy would never be learned.
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


class CalcTask:
    """Prompts, answers and reward of the ``calc`` task, on token ids."""

    def __init__(self, tokenizer):
        tok = tokenizer
        self.digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.comma, self.sep, self.call, self.eq = (tok.convert_tokens_to_ids(c) for c in ",>:=")
        if tok.unk_token_id in self.digit_ids + [self.comma, self.sep, self.call, self.eq]:
            raise ValueError("the tokenizer lacks digit or ',>:=' tokens; use charset 'add1' or 'ascii'")
        self.bos_id = tok.bos_token_id
        self._digit = {t: d for d, t in enumerate(self.digit_ids)}
        self.max_prompt_len = 7

    def prompts(self, count: int, generator: torch.Generator) -> list[list[int]]:
        """``count`` random prompts (operands 10-99)."""
        ops = torch.randint(10, 100, (count, 2), generator=generator).tolist()
        return [[self.bos_id, *self.digits(a, 2), self.comma, *self.digits(b, 2), self.sep] for a, b in ops]

    def digits(self, value: int, width: int) -> list[int]:
        """``value`` as ``width`` digit tokens, zero-padded."""
        return [self.digit_ids[int(c)] for c in f"{value:0{width}d}"]

    def operands(self, prompt: list[int]) -> tuple[int, int]:
        """The two operands of a prompt."""
        d = [self._digit[t] for t in prompt[1:3] + prompt[4:6]]
        return d[0] * 10 + d[1], d[2] * 10 + d[3]

    def reward(self, prompt: list[int], response: list[int], **info) -> float:
        """Fraction of the product's four digits answered in place after the calculator's output."""
        a, b = self.operands(prompt)
        want = self.digits(a * b, 4)
        tool = [self.call, *want, self.eq]
        starts = [i for i in range(len(response) - len(tool) + 1) if response[i:i + len(tool)] == tool]
        if not starts:
            return 0.0
        answer = response[starts[-1] + len(tool):]
        return sum(int(x == y) for x, y in zip(answer, want)) / 4
