"""A fake rollout engine that refuses to evaluate over requests in flight: ``generate`` (the evaluation's call in
the streaming loops) raises while a stream of the same engine still holds a response. On vLLM such a call would
step the stream's requests too and drop their outputs; here it fails the run instead."""

import weakref

from asyncflow.engines.fake import FakeRolloutEngine, FakeStream


class DrainChecked(FakeRolloutEngine):
    """``FakeRolloutEngine`` whose ``generate`` checks that every stream made by ``stream`` is empty."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams: weakref.WeakSet = weakref.WeakSet()

    def stream(self, ignore_eos: bool = False, turns: bool = False) -> FakeStream:
        made = super().stream(ignore_eos, turns)
        self.streams.add(made)
        return made

    def generate(self, prompts, n: int = 1, **kwargs):
        busy = sum(len(s) for s in self.streams)
        if busy:
            raise RuntimeError(f"generate called with {busy} streamed responses in flight (the loop did not drain)")
        return super().generate(prompts, n, **kwargs)
