"""The calculator agent loop of the built-in ``calc`` tool task (``asyncflow.data.synthetic.CalcTask``).

When the model's turn ends with ``:`` (its tool call), the loop appends the product of the prompt's two
operands and ``=`` (``:1776=``); the model then answers after it. Anything else ends the trajectory.
"""

from __future__ import annotations

from asyncflow.agents import AgentLoop, Trajectory
from asyncflow.data.synthetic import CalcTask


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


def make_calculator(tokenizer) -> CalculatorLoop:
    """The calculator tool of the ``calc`` task (``AGENT_LOOPS["calculator"]``)."""
    return CalculatorLoop(tokenizer)
