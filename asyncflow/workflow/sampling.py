"""DAPO dynamic sampling on the driver: feed more prompts into a step until enough groups carry signal.

The advantage task judges whole GRPO groups as they are scored: a group whose rewards are all equal has
zero advantage everywhere (no gradient, only noise in the batch), so it is dropped, and so is any group
beyond the step's quota. It posts ``(kept, judged)`` rows per step to the version board. This planner
turns that into the driver's actions: feed another round of prompts when the rows kept plus the rows
still being generated cannot fill the step, seal the step's partition once it is full (which ends the
step for the rollout, reward and advantage tasks). Rounds are sized by the keep rate seen so far.
"""

from __future__ import annotations

import dataclasses
import math


class SamplingBudgetError(RuntimeError):
    """A step needed more prompts than ``algorithm.max_sampling_factor`` allows."""


@dataclasses.dataclass
class _Step:
    fed_rows: int = 0
    kept: int = 0
    judged: int = 0
    sealed: bool = False


class DynamicSampling:
    """Per-step bookkeeping of fed, judged and kept rows; ``plan`` says what to feed and what to seal."""

    def __init__(self, prompts_per_step: int, group_size: int, max_factor: float):
        self.target = prompts_per_step * group_size
        self.group_size = group_size
        self.max_prompts = max(int(math.ceil(max_factor * prompts_per_step)), prompts_per_step)
        self.steps: dict[int, _Step] = {}
        self.keep_rate = 1.0  # kept / judged over the run so far; sizes the next rounds

    def fed(self, step: int, prompts: int) -> None:
        """``prompts`` prompts (one group each) went into ``step``."""
        self.steps.setdefault(step, _Step()).fed_rows += prompts * self.group_size

    def progress(self, updates: dict[int, tuple[int, int]]) -> None:
        """Take the advantage task's cumulative ``(kept, judged)`` per step."""
        for step, (kept, judged) in updates.items():
            state = self.steps.setdefault(step, _Step())
            state.kept, state.judged = max(state.kept, kept), max(state.judged, judged)
        judged = sum(s.judged for s in self.steps.values())
        if judged:
            self.keep_rate = max(sum(s.kept for s in self.steps.values()) / judged, 0.05)

    def plan(self) -> tuple[dict[int, int], list[int]]:
        """``({step: prompts to feed}, [steps to seal])`` given what is known now."""
        feed, seal = {}, []
        for step, state in sorted(self.steps.items()):
            if state.sealed:
                continue
            if state.kept >= self.target:
                state.sealed = True
                seal.append(step)
                continue
            pending = state.fed_rows - state.judged
            deficit = self.target - state.kept - int(pending * self.keep_rate)
            if deficit <= 0 or pending >= self.target:
                continue  # what is in flight should fill the step; wait for it to be judged
            prompts = math.ceil(deficit / self.keep_rate / self.group_size)
            fed_prompts = state.fed_rows // self.group_size
            if fed_prompts >= self.max_prompts:
                raise SamplingBudgetError(
                    f"step {step}: {fed_prompts} prompts fed, {state.kept // self.group_size} groups with reward "
                    f"signal kept of {self.target // self.group_size} needed; raise algorithm.max_sampling_factor "
                    "or use prompts the policy sometimes solves and sometimes fails")
            feed[step] = min(prompts, self.max_prompts - fed_prompts)
        return feed, seal

    def next_group_id(self, step: int) -> int:
        """Group id of the next prompt fed into ``step``: a step's ids never collide with another step's."""
        return step * self.max_prompts + self.steps.get(step, _Step()).fed_rows // self.group_size
