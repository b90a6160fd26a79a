"""The built-in tool task: two-digit multiplication with a calculator tool (``workflow.task: calc``,
``algorithm.reward: calc``, ``agent.loop: calculator``).

Prompt ``<bos> a1 a2 , b1 b2 >``; the answer is the product as four digits (``37,48>`` -> ``1776``). Doing
that token by token is beyond a tiny model, but it may call the calculator by emitting ``:``. The loop then
appends the tool's output, the product and ``=`` (``:1776=``), and the model answers after it; copying
four digits at a fixed offset is what the tiny model learns on ``add1`` within a few dozen steps. So the
reward rises only once the model learns to call the tool.

The reward scores the four tokens after the calculator's output (``:1776=``) in the response: the fraction
of the product's digits in the right place; 0 when the response holds no such output. (A first version
also scored answers without a tool call: the model then learned to guess digit statistics and called the
tool less and less, the copy was never learned; reward 0.05 -> 0.10 in 80 steps.)
"""

from __future__ import annotations

import torch

from asyncflow.agents import AGENT_LOOPS, AgentLoop, Trajectory
from asyncflow.data.sources import SyntheticPrompts


class CalcTask:
    """Prompts, answers and reward of the multiplication task, on token ids."""

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
        """Fraction of the product's four digits answered in place."""
        a, b = self.operands(prompt)
        want = self.digits(a * b, 4)
        tool = [self.call, *want, self.eq]
        starts = [i for i in range(len(response) - len(tool) + 1) if response[i:i + len(tool)] == tool]
        if not starts:
            return 0.0
        answer = response[starts[-1] + len(tool):]
        return sum(int(x == y) for x, y in zip(answer, want)) / 4


class CalculatorLoop(AgentLoop):
    """Runs the calculator when the model's turn ends with ``:``; anything else ends the trajectory."""

    def __init__(self, tokenizer):
        self.task = CalcTask(tokenizer)
        self.stop_token_ids = (self.task.call,)

    def observe(self, trajectory: Trajectory) -> list[int] | None:
        resp = trajectory.response_ids
        if not resp or resp[-1] != self.task.call:
            return None
        a, b = self.task.operands(trajectory.prompt_ids)
        return [*self.task.digits(a * b, 4), self.task.eq]


@AGENT_LOOPS.register("calculator")
def make_calculator(tokenizer) -> CalculatorLoop:
    """The calculator tool of the ``calc`` task."""
    return CalculatorLoop(tokenizer)


class CalcPrompts(SyntheticPrompts):
    """Endless random prompts of the ``calc`` task (the prompt-source interface of ``asyncflow.data``)."""

    def __init__(self, tokenizer, seed: int = 0, data_cfg=None):
        super().__init__(seed)
        self.task = CalcTask(tokenizer)
        self.max_prompt_len = self.task.max_prompt_len
