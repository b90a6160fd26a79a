"""A small discrete-event kernel: processes are generators that yield events; devices are shared.

    def worker(sim, device):
        yield sim.timeout(1.0)          # wait
        yield device.run(2.0)           # 2 s of work on a processor-shared device
        yield sim.all_of([e1, e2])      # wait for several events

``Device`` is processor sharing: ``n`` jobs on one device each progress at ``1/n`` of its speed, which is
what two processes pinned to one core (or two worker groups taking turns on one GPU) look like from
outside. No library here: simpy would do, but it is not a dependency and this needs 100 lines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator, Iterable


class Event:
    """Something that happens once; processes waiting on it resume with its value."""

    def __init__(self, sim: Sim):
        self.sim = sim
        self.triggered = False
        self.value = None
        self._callbacks: list[Callable[[Event], None]] = []

    def succeed(self, value=None) -> Event:
        """Trigger now (callbacks run at the current time, in order)."""
        if self.triggered:
            raise RuntimeError("event triggered twice")
        self.triggered, self.value = True, value
        for cb in self._callbacks:
            self.sim.at(self.sim.now, lambda cb=cb: cb(self))
        self._callbacks.clear()
        return self

    def on(self, callback: Callable[[Event], None]) -> None:
        """Call ``callback(event)`` once triggered (at once, if it already is)."""
        if self.triggered:
            self.sim.at(self.sim.now, lambda: callback(self))
        else:
            self._callbacks.append(callback)


class Sim:
    """The clock and the event queue."""

    def __init__(self):
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at time ``when`` (ties run in scheduling order)."""
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn))

    def event(self) -> Event:
        """A fresh untriggered event."""
        return Event(self)

    def timeout(self, delay: float, value=None) -> Event:
        """An event that triggers ``delay`` seconds from now."""
        ev = Event(self)
        self.at(self.now + max(delay, 0.0), lambda: ev.succeed(value))
        return ev

    def all_of(self, events: Iterable[Event]) -> Event:
        """An event that triggers once every one of ``events`` has (with their values, in order)."""
        events = list(events)
        done = Event(self)
        left = [len(events)]
        if not events:
            return done.succeed([])

        def one(_):
            left[0] -= 1
            if left[0] == 0:
                done.succeed([e.value for e in events])

        for e in events:
            e.on(one)
        return done

    def process(self, gen: Generator) -> Event:
        """Start a generator process now; the returned event triggers with its return value."""
        finished = Event(self)

        def step(value=None):
            try:
                target = gen.send(value)
            except StopIteration as stop:
                finished.succeed(stop.value)
                return
            if not isinstance(target, Event):
                raise TypeError(f"a process yielded {target!r}; processes yield events")
            target.on(lambda ev: step(ev.value))

        self.at(self.now, step)
        return finished

    def run(self, until: float | None = None) -> None:
        """Process events until none are left (or the clock passes ``until``)."""
        while self._queue:
            when, _, fn = self._queue[0]
            if until is not None and when > until:
                self.now = until
                return
            heapq.heappop(self._queue)
            self.now = when
            fn()


class Device:
    """A processor-shared device: concurrent jobs split its speed equally. ``busy`` is the union of the
    intervals in which at least one job ran (for idle fractions)."""

    def __init__(self, sim: Sim, name: str, speed: float = 1.0):
        self.sim, self.name, self.speed = sim, name, speed
        self._jobs: dict[int, list] = {}  # id -> [remaining work, event]
        self._ids = itertools.count()
        self._last = 0.0
        self._epoch = 0  # invalidates completions scheduled before the job set changed
        self.busy = 0.0
        self.spill: tuple[float, list[Device]] = (0.0, [])
        """``(factor, devices)``: every job run here adds ``factor x`` its work, split evenly over ``devices``,
        as jobs nobody waits for (processes that float over those devices, driven by this one's work)."""

    def run(self, work: float) -> Event:
        """An event that triggers once ``work`` seconds of this device's undivided time have been served."""
        factor, peers = self.spill
        if work > 0 and factor > 0:
            for peer in peers:
                peer.background(factor * work / len(peers))
        return self._add(work, Event(self.sim))

    def background(self, work: float) -> None:
        """``work`` seconds of a job nobody waits for (a process that floats onto this device)."""
        self._add(work, Event(self.sim))

    def _add(self, work: float, ev: Event) -> Event:
        self._advance()
        if work <= 0:
            return ev.succeed()
        self._jobs[next(self._ids)] = [work, ev]
        self._reschedule()
        return ev

    def _advance(self) -> None:
        now = self.sim.now
        if self._jobs:
            share = (now - self._last) * self.speed / len(self._jobs)
            for job in self._jobs.values():
                job[0] -= share
            self.busy += now - self._last
        self._last = now

    def _reschedule(self) -> None:
        self._epoch += 1
        if not self._jobs:
            return
        epoch, least = self._epoch, min(job[0] for job in self._jobs.values())
        self.sim.at(self.sim.now + max(least, 0.0) * len(self._jobs) / self.speed, lambda: self._complete(epoch))

    def _complete(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        done = [k for k, job in self._jobs.items() if job[0] <= 1e-9]
        for k in done:
            self._jobs.pop(k)[1].succeed()
        self._reschedule()
