"""A user agent loop loaded by dotted path in tests/workflow/test_stream.py: on the ``calc`` task, every model turn
is one token (every token is a stop token) and the tool answers with ``OBSERVATION`` tokens, so each trajectory runs
``agent.max_turns`` turns unless its tool fails; by the prompt's first operand, the tool raises (``a % 4 == 0``),
hangs past the run's agent.tool_timeout_s (``a % 4 == 1``, for ``HANG_S``) or answers at once. ``SlowTools``: every
call answers after ``SLOW_S`` (trajectories spend most of their time waiting for their tool) and marks the wait in
``waiting_dir`` (which instance holds a trajectory waiting for its tool, for a test to kill)."""

import os
import threading
import time
from pathlib import Path

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


def waiting_dir(model_dir) -> Path:
    """Where ``SlowTools`` marks each call while it waits: a file ``<pid>-...`` per call, beside the model (a folder
    of the test session's own)."""
    return Path(model_dir).parent / "tool-waits"


def waiting_pids(model_dir) -> set[int]:
    """The pids of the processes with a tool call waiting now (or killed while one waited)."""
    try:
        return {int(name.split("-", 1)[0]) for name in os.listdir(waiting_dir(model_dir))}
    except FileNotFoundError:
        return set()


class SlowTools(OneTokenTurns):
    """One-token turns; every call answers ``OBSERVATION`` tokens after ``SLOW_S``, marked in ``waiting_dir``."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.waits = waiting_dir(tokenizer.name_or_path)
        self.waits.mkdir(exist_ok=True)

    def observe(self, trajectory):
        mark = self.waits / f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        mark.touch()
        try:
            time.sleep(SLOW_S)
        finally:
            mark.unlink(missing_ok=True)
        return [self.task.call, self.task.eq][:OBSERVATION]


def make_slow_loop(tokenizer) -> SlowTools:
    """Factory with the agent-loop signature."""
    return SlowTools(tokenizer)
