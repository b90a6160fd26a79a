"""A fake rollout engine slow enough to be the run's bottleneck, for tests that kill a rollout instance while it
generates (``tests/workflow/test_restart_continuous.py``): named by dotted path in a run's overrides."""

import dataclasses

from asyncflow.engines.fake import FakeRolloutEngine


class BusyTokens(FakeRolloutEngine):
    """50 ms per engine step (one token of every running sequence): with a few slots, a step's rollout takes longer
    than its training, so an instance always has rows in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = dataclasses.replace(self.faults, token_s=0.05)
