"""Console progress: one plain line per step (or per ``every_s`` seconds) that reads well in CI logs.

No carriage-return animation: CI logs and ``tee`` keep every byte, so a redrawn bar becomes thousands of
lines of noise. With ``rich`` installed and a terminal attached, numbers are highlighted; the text is the
same either way.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import keys


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _fmt(metrics: Mapping[str, Any], key: str, spec: str, width: int) -> str:
    value = metrics.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return format(float(value), spec).rjust(width)


def _rich_printer() -> Callable[[str], None] | None:
    if not sys.stdout.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console(soft_wrap=True)
    return lambda line: console.print(line, markup=False, highlight=True)


class ProgressReporter:
    """Prints a progress line per step, at most one per ``every_s`` seconds; the first and last always print.

    A line reads::

        step   12/100 | reward  0.431 | 25.3 samples/s | 410 tok/s | lag 0.50 max 1 | queue 32 | 0:01:23 eta 0:09:10

    Values come from the standard metric names in ``keys``; a missing one prints as ``-``.

    Args:
        total_steps: steps of the run (None when unknown: no ``/total`` and no ETA).
        every_s: least seconds between two lines; 0 prints every step.
        print_fn: where lines go (default: ``print(..., flush=True)``, or rich on a terminal).
        start_time: ``time.monotonic()`` at the run's start (default: now).
    """

    def __init__(self, total_steps: int | None = None, every_s: float = 2.0,
                 print_fn: Callable[[str], None] | None = None, start_time: float | None = None):
        self.total_steps = total_steps
        self.every_s = every_s
        self.print_fn = print_fn or _rich_printer() or (lambda line: print(line, flush=True))
        self.start_time = time.monotonic() if start_time is None else start_time
        self._last_print: float | None = None
        self._last_step: int | None = None
        self._steps_done = 0

    def format_line(self, step: int, metrics: Mapping[str, Any]) -> str:
        """The progress line for ``step`` without printing it."""
        elapsed = time.monotonic() - self.start_time
        width = len(str(self.total_steps)) if self.total_steps else 4
        head = f"step {step:>{width}d}" + (f"/{self.total_steps}" if self.total_steps else "")
        clock = _fmt_duration(elapsed)
        if self.total_steps and self._steps_done and step < self.total_steps:
            clock += f" eta {_fmt_duration(elapsed / self._steps_done * (self.total_steps - step))}"
        return " | ".join([
            head,
            f"reward {_fmt(metrics, keys.REWARD_MEAN, '.3f', 6)}",
            f"{_fmt(metrics, keys.SAMPLES_PER_S, '.1f', 6)} samples/s",
            f"{_fmt(metrics, keys.TOKENS_PER_S, '.0f', 6)} tok/s",
            f"lag {_fmt(metrics, keys.LAG_MEAN, '.2f', 4)} max {_fmt(metrics, keys.LAG_MAX, '.0f', 1)}",
            f"queue {_fmt(metrics, keys.QUEUE_DEPTH, '.0f', 4)}",
            clock,
        ])

    def update(self, step: int, metrics: Mapping[str, Any], force: bool = False) -> str | None:
        """Report step ``step``; returns the printed line, or None when throttled by ``every_s``."""
        self._steps_done += 1
        self._last_step = step
        now = time.monotonic()
        last = self.total_steps is not None and step >= self.total_steps
        due = self._last_print is None or now - self._last_print >= self.every_s
        if not (force or last or due):
            return None
        line = self.format_line(step, metrics)
        self.print_fn(line)
        self._last_print = now
        return line

    def finish(self, extra: str = "") -> str:
        """Print and return a closing summary line (steps, wall time, and ``extra`` when given)."""
        elapsed = time.monotonic() - self.start_time
        line = f"done: {self._steps_done} steps in {_fmt_duration(elapsed)} ({elapsed:.1f} s)"
        if extra:
            line += f" | {extra}"
        self.print_fn(line)
        return line


class StartupLog:
    """One line per start-up phase of a run, as it begins or ends, with the seconds since the run started, so that a
    slow start (Ray on a busy cluster, engines loading a large model) shows where it is::

        start-up    0.0 s | starting Ray
        start-up    4.1 s | TransferQueue up
        start-up    4.3 s | rollout engines loading (vllm, 2 instances); trainer loading (megatron, 4 ranks)

    Args:
        print_fn: where lines go (default: ``print(..., flush=True)``).
        start_time: ``time.monotonic()`` at the run's start (default: now).
    """

    def __init__(self, print_fn: Callable[[str], None] | None = None, start_time: float | None = None):
        self.print_fn = print_fn or (lambda line: print(line, flush=True))
        self.start_time = time.monotonic() if start_time is None else start_time

    def phase(self, what: str) -> str:
        """Print and return the line of phase ``what``."""
        line = f"start-up {time.monotonic() - self.start_time:6.1f} s | {what}"
        self.print_fn(line)
        return line
