"""A small discrete-event kernel: processes are generators that yield events; devices are shared.

    def worker(sim, device):
        yield sim.timeout(1.0)          # wait
        yield device.run(2.0)           # 2 s of work on a processor-shared device
        yield sim.all_of([e1, e2])      # wait for several events

``Device`` is processor sharing: ``n`` jobs on one device each progress at ``1/n`` of its speed, which is
what two processes pinned to one core (or two worker groups taking turns on one GPU) look like from
outside. A ``Pool`` links devices that also serve work floating over all of them (processes the OS places on
whichever core is free). No library here: simpy would do, but it is not a dependency and this needs 200 lines.
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
    """A processor-shared device: concurrent jobs split its speed equally. Devices linked to a ``Pool`` also serve
    its floating work, and then change speed together."""

    def __init__(self, sim: Sim, name: str, speed: float = 1.0):
        self.sim, self.name, self.speed = sim, name, speed
        self._jobs: dict[int, list] = {}  # id -> [remaining work, event]
        self._ids = itertools.count()
        self._last = 0.0
        self._rate = 0.0  # the speed each job gets now
        self._epoch = 0  # invalidates completions scheduled before the job set changed
        self.busy = 0.0
        """Seconds in which it ran anything: its jobs, or a pool's floating work."""
        self.pool: Pool | None = None
        self.spill = 0.0
        """Every job run here adds ``spill x`` its work to ``pool`` (processes that float over the pool's devices,
        driven by this one's work)."""

    def run(self, work: float) -> Event:
        """An event that triggers once ``work`` seconds of this device's undivided time have been served."""
        if work > 0 and self.spill > 0 and self.pool is not None:
            self.pool.add(self.spill * work)
        return self._add(work, Event(self.sim))

    def _add(self, work: float, ev: Event) -> Event:
        if work <= 0:
            return ev.succeed()
        self._advance()
        self._jobs[next(self._ids)] = [work, ev]
        self._reschedule()
        return ev

    def _advance(self) -> None:
        if self.pool is not None:
            self.pool.advance()
        else:
            self._advance_own()

    def _reschedule(self) -> None:
        if self.pool is not None:
            self.pool.reschedule()
        else:
            self._rate = self.speed / max(len(self._jobs), 1)
            self._schedule()

    def _advance_own(self) -> None:
        now = self.sim.now
        if self._jobs:
            for job in self._jobs.values():
                job[0] -= (now - self._last) * self._rate
            self.busy += now - self._last
        self._last = now

    def _schedule(self) -> None:
        self._epoch += 1
        if not self._jobs:
            return
        epoch, least = self._epoch, min(job[0] for job in self._jobs.values())
        self.sim.at(self.sim.now + max(least, 0.0) / self._rate, lambda: self._complete(epoch))

    def _complete(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        done = [k for k, job in self._jobs.items() if job[0] <= 1e-9]
        for k in done:
            self._jobs.pop(k)[1].succeed()
        self._reschedule()


class Pool:
    """Work of processes that float over ``devices`` (e.g. the cores every pinned worker shares with the OS's
    other processes) and that nobody waits for. An idle device serves it at full speed, as the OS moves a
    runnable process to an idle core; only when every device is busy does it take a fair share of each (one
    more job on each), slowing the jobs there. ``served`` is how much of it each device ran."""

    def __init__(self, sim: Sim, devices: list[Device]):
        self.sim, self.devices = sim, devices
        self.left = 0.0
        self.served = {d.name: 0.0 for d in devices}
        self._rates: dict[str, float] = {}
        self._last = 0.0
        self._epoch = 0
        for device in devices:
            device.pool = self

    def add(self, work: float) -> None:
        """``work`` seconds of floating work, served from now on."""
        if work <= 0:
            return
        self.advance()
        self.left += work
        self.reschedule()

    def advance(self) -> None:
        """Bring every linked device and the pool's own work up to now."""
        now = self.sim.now
        for device in self.devices:
            if not device._jobs and device.name in self._rates:  # idle but for the floating work: busy with it
                device.busy += now - self._last
            device._advance_own()
        for name, rate in self._rates.items():
            done = min((now - self._last) * rate, self.left)
            self.served[name] += done
            self.left -= done
        if self.left <= 1e-12:  # float rounding: what is left is nothing, so no completion is scheduled for it
            self.left = 0.0
        self._last = now

    def reschedule(self) -> None:
        """Split each device's speed between its jobs and the pool, and schedule the next completion."""
        idle = [d for d in self.devices if not d._jobs]
        self._rates = {}
        for device in self.devices:
            n = len(device._jobs)
            speed = device.speed
            if self.left > 0 and not idle:  # all busy: one more fair share on each
                self._rates[device.name] = speed / (n + 1)
                device._rate = speed / (n + 1)
            else:
                device._rate = speed / max(n, 1)
                if self.left > 0 and n == 0:
                    self._rates[device.name] = speed
            device._schedule()
        self._epoch += 1
        rate = sum(self._rates.values())
        if rate > 0:
            epoch = self._epoch
            self.sim.at(self.sim.now + self.left / rate, lambda: self._drained(epoch))

    def _drained(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self.advance()
        self.left = 0.0
        self.reschedule()
