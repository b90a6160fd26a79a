"""A user agent loop loaded by dotted path in tests/workflow/test_stream.py: on the ``calc`` task, every model turn
is one token (every token is a stop token) and the tool answers with ``OBSERVATION`` tokens, so each trajectory runs
``agent.max_turns`` turns unless its tool fails; by the prompt's first operand, the tool raises (``a % 4 == 0``),
hangs past the run's agent.tool_timeout_s (``a % 4 == 1``, for ``HANG_S``) or answers at once. ``SlowTools``: every
call answers after ``SLOW_S`` (trajectories spend most of their time waiting for their tool)."""

import time

from asyncflow.agents.calculator import CalculatorLoop

OBSERVATION = 2
"""Tokens each answered call appends (masked out of the loss)."""
HANG_S = 3.0
SLOW_S = 0.5


class OneTokenTurns(CalculatorLoop):
    """One-token turns; the tool raises, hangs or answers ``OBSERVATION`` tokens, by the first operand."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stop_token_ids = tuple(range(len(tokenizer)))

    def observe(self, trajectory):
        a, b = self.task.operands(trajectory.prompt_ids)
        if a % 4 == 0:
            raise ConnectionError(f"calculator service unavailable for {a}")
        if a % 4 == 1:
            time.sleep(HANG_S)
        return [self.task.call, self.task.eq][:OBSERVATION]


def make_loop(tokenizer) -> OneTokenTurns:
    """Factory with the agent-loop signature."""
    return OneTokenTurns(tokenizer)


class SlowTools(OneTokenTurns):
    """One-token turns; every call answers ``OBSERVATION`` tokens after ``SLOW_S``."""

    def observe(self, trajectory):
        time.sleep(SLOW_S)
        return [self.task.call, self.task.eq][:OBSERVATION]


def make_slow_loop(tokenizer) -> SlowTools:
    """Factory with the agent-loop signature."""
    return SlowTools(tokenizer)
