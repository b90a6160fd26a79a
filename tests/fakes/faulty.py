"""Fake rollout engines that fail on purpose, for in-process runs on a shared Ray (whose workers do not see a
test's environment, so ``ASYNCFLOW_FAKE_*`` cannot reach them): named by dotted path in a run's overrides."""

import dataclasses

from asyncflow.engines.fake import FakeRolloutEngine


class FailsApplyingFrom2(FakeRolloutEngine):
    """``apply_staged`` of weight version 2 and every later one raises (the engine survives)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, fail_apply_from=2)


class DiesApplying2(FakeRolloutEngine):
    """The rollout's process SIGKILLs itself when it starts applying weight version 2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, die_applying=2)
