"""Fake engines slowed down on purpose, for in-process runs on a shared Ray (whose workers do not see a test's
environment, so ``ASYNCFLOW_FAKE_*`` cannot reach them): named by dotted path in a run's overrides."""

import dataclasses

from asyncflow.engines.fake import FakeRolloutEngine, FakeTrainEngine


class SlowTrainer(FakeTrainEngine):
    """Every ``train_step`` takes 0.3 s more: rollout is always ready before the trainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, train_s=0.3)


class SlowTokens(FakeRolloutEngine):
    """5 ms per engine step (one token of every running sequence): a step's rollout outlasts the training tail
    of the step before, so versions arrive mid-rollout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, token_s=0.005)
