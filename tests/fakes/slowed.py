"""Fake engines slowed down on purpose, for in-process runs on a shared Ray (whose workers do not see a test's
environment, so ``ASYNCFLOW_FAKE_*`` cannot reach them): named by dotted path in a run's overrides."""

import dataclasses
import time

from asyncflow.engines.fake import FakeRolloutEngine, FakeStream, FakeTrainEngine


class SlowTrainer(FakeTrainEngine):
    """Every ``train_step`` takes 0.3 s more: rollout is always ready before the trainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, train_s=0.3)


class Gate:
    """A Ray actor (named ``GATE``, made by the test) that says how many train steps may run: a test opens it
    step by step to hold a run at a point while it acts on it (``GatedTrainer``)."""

    def __init__(self):
        self.allowed = 0

    def open(self, steps: int) -> None:
        self.allowed = max(self.allowed, steps)

    def get(self) -> int:
        return self.allowed


GATE = "test-train-gate"


class GatedTrainer(FakeTrainEngine):
    """The optimizer steps of the run's step ``n`` (weight version ``n``; ``algorithm.ppo_epochs`` of them) wait
    until the named ``Gate`` allows ``n + 1`` steps."""

    def train_step(self, *args, **kwargs) -> dict:
        import ray

        gate = ray.get_actor(GATE)
        while ray.get(gate.get.remote()) <= self.version:
            time.sleep(0.02)
        return super().train_step(*args, **kwargs)


class SlowTokens(FakeRolloutEngine):
    """5 ms per engine step (one token of every running sequence): a step's rollout outlasts the training tail
    of the step before, so versions arrive mid-rollout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, token_s=0.005)


class LongTail(FakeRolloutEngine):
    """The first response of every 16th prompt in the sample stream (group id 0, 16, 32, ...) comes back only once
    the engine serves a version ``HOLD_VERSIONS`` newer than the one that generated it, as a long-tailed response
    would: it holds its slot meanwhile. A prompt generated again (its group went stale) comes back at once. With
    ``rollout.partial=true`` the engine takes new versions while the held response is in it; without, only once the
    sample stream drops the held response's group (it can only go stale)."""

    HOLD_VERSIONS = 2
    EVERY = 16

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held_once: set = set()  # group ids whose response was held back already

    def stream(self, ignore_eos: bool = False, turns: bool = False):
        return _LongTailStream(self, ignore_eos, turns)


class _LongTailStream(FakeStream):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held: list = []  # (key, sample)

    def __len__(self) -> int:
        return super().__len__() + len(self._held)

    @property
    def free(self) -> int:
        return max(super().free - len(self._held), 0)

    def step(self) -> list:
        out, engine = [], self.engine
        for key, sample in super().step():
            gid = key[0] if isinstance(key, tuple) else None
            if isinstance(gid, int) and gid % engine.EVERY == 0 and key[1] == 0 and gid not in engine.held_once:
                engine.held_once.add(gid)
                self._held.append((key, sample))
            else:
                out.append((key, sample))
        due, held = [], []
        for key, sample in self._held:
            (due if engine.version >= sample.weight_version + engine.HOLD_VERSIONS else held).append((key, sample))
        self._held = held
        if not out and not due and not super().__len__():
            time.sleep(0.005)  # only held responses left: do not spin
        return out + due

    def abort(self) -> int:
        """Drop every in-flight response, the held ones too."""
        held, self._held = len(self._held), []
        return super().abort() + held
