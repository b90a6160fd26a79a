"""The version board: where the trainer publishes weight versions and rollout waits for admission.

A small asyncio Ray actor. The staleness rule lives in ``admitted_version``: rollout may start
generating the samples of step ``s`` once weights of version ``s - k`` exist, so every sample of step
``s`` comes from a version ``v >= s - k`` and is trained at step ``s <= v + k``. Workers also drop
their per-step metrics and timeline spans here for the driver to collect.
"""

from __future__ import annotations

import asyncio


def admitted_version(step: int, max_staleness: int) -> int:
    """The oldest weight version allowed to generate the samples of ``step``."""
    return max(step - max_staleness, 0)


class VersionBoard:
    """Latest published weights (as an object reference), plus a mailbox of worker reports."""

    def __init__(self):
        self._version = 0
        self._weights: list | None = None  # ObjectRefs (one per part) in a list so Ray passes the refs
        self._parts: dict[int, dict[int, list]] = {}  # version -> part -> refs, until all parts arrived
        self._cond: asyncio.Condition | None = None
        self._reports: list[dict] = []
        self._sampling: dict[int, tuple[int, int]] = {}  # step -> (kept rows, judged rows), dynamic sampling
        self._aborted: str | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily: it must belong to the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    async def publish(self, version: int, weights: list, part: int = 0, num_parts: int = 1) -> None:
        """Post part ``part`` of ``num_parts`` of weights ``version``: ``[ObjectRef, ...]``, the safetensors
        buckets of one pipeline stage. The version becomes the newest once every part is in; readers get
        all buckets in stage order."""
        cond = self._condition()
        async with cond:
            if version <= self._version and self._weights is not None:
                raise ValueError(f"version {version} published after {self._version}: versions must increase")
            parts = self._parts.setdefault(version, {})
            parts[part] = list(weights)
            if len(parts) < num_parts:
                return
            del self._parts[version]
            self._version, self._weights = version, [ref for i in range(num_parts) for ref in parts[i]]
            cond.notify_all()

    async def wait_for_version(self, min_version: int, timeout_s: float) -> tuple[int, list | None]:
        """Block until a version >= ``min_version`` exists; return the newest ``(version, [ref, ...])``."""
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._version >= min_version or self._aborted),
                                       timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"rollout waited {timeout_s:.0f} s for weight version {min_version}; newest is "
                    f"{self._version} (is the trainer alive?)"
                ) from None
            if self._aborted and self._version < min_version:
                raise RuntimeError(f"run aborted while waiting for weight version {min_version}: {self._aborted}")
            return self._version, self._weights

    async def abort(self, reason: str) -> None:
        """Fail every present and future wait for a version not published yet (the run has failed)."""
        cond = self._condition()
        async with cond:
            self._aborted = reason
            cond.notify_all()

    async def version(self) -> int:
        """The newest published version."""
        return self._version

    async def report(self, item: dict) -> None:
        """A worker's per-step metrics and timeline spans."""
        self._reports.append(item)

    async def take_reports(self) -> list[dict]:
        """Every report since the last call."""
        items, self._reports = self._reports, []
        return items

    async def sampling_progress(self, step: int, kept: int, judged: int) -> None:
        """Dynamic sampling: of the rows of ``step`` judged so far, ``kept`` were kept (cumulative)."""
        self._sampling[step] = (kept, judged)

    async def take_sampling(self) -> dict[int, tuple[int, int]]:
        """The latest progress of every step with news since the last call."""
        items, self._sampling = self._sampling, {}
        return items
