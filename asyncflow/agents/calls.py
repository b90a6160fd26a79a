"""Agent-loop calls off the engine loop: ``turn_reward`` and ``observe`` run in workers while the engine steps.

    engine loop ── a turn ends ──► submit(key, trajectory) ──► a worker thread (plain ``observe``)
         ▲                                                     or a coroutine on the event-loop thread
         │                                                     (``async def observe``), at most
         │                                                     ``agent.tool_workers`` at once
         └── ready(): (key, Outcome) for every call answered, failed, or past ``agent.tool_timeout_s`` ◄─┘

The engine keeps stepping the other sequences while a call runs; the rollout stream re-admits a trajectory
for its next turn once its outcome is ready. A call's deadline counts from its submission (waiting for a free
worker included), so a pool whose every worker hangs still answers each call by its deadline.

A plain ``observe`` runs on a thread and cannot be stopped: a timed-out call's thread runs on to the end, its
result is dropped, and a fresh thread takes its place (threads are daemons, so a hung tool never holds the
process at exit). An ``async def observe`` is cancelled at its deadline; it must not block its event loop (use
``await asyncio.sleep``, an async HTTP client, ``asyncio.to_thread`` for blocking work), or every other async
call waits with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent import futures

from asyncflow.agents import AgentLoop, Trajectory


@dataclasses.dataclass
class Outcome:
    """What one call gave: the observation (None: the trajectory is done) and the turn's reward, or the error
    the loop raised, or ``timed_out`` when it did not answer in time (then neither is known)."""

    observation: list[int] | None = None
    turn_reward: float = 0.0
    error: BaseException | None = None
    timed_out: bool = False


class _Threads:
    """Daemon worker threads over one queue; a thread whose call was abandoned (timed out) is replaced, and
    leaves once its call returns, so ``size`` threads always serve the queue."""

    def __init__(self, size: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned: set[futures.Future] = set()
        self.lock = threading.Lock()
        self.size = size
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="agent-call", daemon=True).start()

    def submit(self, fn: Callable, *args) -> futures.Future:
        future: futures.Future = futures.Future()
        self.jobs.put((future, fn, args))
        return future

    def abandon(self, future: futures.Future) -> None:
        """``future`` timed out: cancel it if it has not started, else let a fresh thread take its place."""
        if future.cancel():
            return
        with self.lock:
            if future.done():
                return
            self.abandoned.add(future)
        self._spawn()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller with the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            with self.lock:
                if future in self.abandoned:  # a replacement serves the queue now
                    self.abandoned.discard(future)
                    return

    def close(self) -> None:
        for _ in range(self.size):
            self.jobs.put(None)


class AgentCalls:
    """Runs an ``AgentLoop``'s calls concurrently: ``workers`` threads for a plain ``observe``, or up to ``workers``
    coroutines on one event-loop thread for an ``async def observe`` (its ``turn_reward`` may then be async too).

    Per call, in a worker: ``turn_reward(trajectory)``, then ``observe(trajectory)`` unless ``ask`` is False
    (the trajectory is at its last turn). Exceptions come back in ``Outcome.error``; a call not answered
    ``timeout_s`` after its submission comes back as ``Outcome(timed_out=True)`` and is counted in
    ``timeouts``."""

    def __init__(self, loop: AgentLoop, workers: int, timeout_s: float):
        self.loop, self.timeout_s = loop, timeout_s
        self.is_async = inspect.iscoroutinefunction(loop.observe)
        self.timeouts = 0
        self._calls: dict[Hashable, tuple[futures.Future, float]] = {}
        self._threads: _Threads | None = None
        self._events: asyncio.AbstractEventLoop | None = None
        if self.is_async:
            self._events = asyncio.new_event_loop()
            self._limit = asyncio.Semaphore(workers)
            threading.Thread(target=self._serve_events, name="agent-calls-async", daemon=True).start()
        else:
            self._threads = _Threads(workers)

    def _serve_events(self) -> None:
        self._events.run_forever()
        self._events.close()

    def __len__(self) -> int:
        """Calls submitted and not yet handed back by ``ready``."""
        return len(self._calls)

    def submit(self, key: Hashable, trajectory: Trajectory, ask: bool = True) -> None:
        """Start the call for ``key``'s finished turn (one call per key at a time)."""
        if self._events is not None:
            future = asyncio.run_coroutine_threadsafe(self._call_async(trajectory, ask), self._events)
        else:
            future = self._threads.submit(self._call, trajectory, ask)
        self._calls[key] = (future, time.monotonic() + self.timeout_s)

    def _call(self, trajectory: Trajectory, ask: bool) -> Outcome:
        out = Outcome()
        try:
            out.turn_reward = float(self.loop.turn_reward(trajectory))
            out.observation = self.loop.observe(trajectory) if ask else None
        except Exception as exc:  # noqa: BLE001 - one tool failure ends its trajectory, not the run
            out.error = exc
        return out

    async def _call_async(self, trajectory: Trajectory, ask: bool) -> Outcome:
        out = Outcome()
        async with self._limit:
            try:
                reward = self.loop.turn_reward(trajectory)
                out.turn_reward = float(await reward if inspect.isawaitable(reward) else reward)
                out.observation = await self.loop.observe(trajectory) if ask else None
            except Exception as exc:  # noqa: BLE001 - as in ``_call``
                out.error = exc
        return out

    def ready(self, wait_s: float = 0.0) -> list[tuple[Hashable, Outcome]]:
        """The calls answered or past their deadline, in submission order; waits up to ``wait_s`` for the first
        one when none is ready yet."""
        if wait_s > 0 and self._calls:
            nearest = min(deadline for _, deadline in self._calls.values())
            futures.wait([f for f, _ in self._calls.values()], return_when=futures.FIRST_COMPLETED,
                         timeout=max(0.0, min(wait_s, nearest - time.monotonic())))
        now, out = time.monotonic(), []
        for key, (future, deadline) in list(self._calls.items()):
            if future.done():
                del self._calls[key]
                error = None if future.cancelled() else future.exception()
                out.append((key, Outcome(error=error) if error is not None else future.result()))
            elif now >= deadline:
                del self._calls[key]
                self.timeouts += 1
                if self._threads is not None:
                    self._threads.abandon(future)
                else:
                    future.cancel()  # cancels the coroutine at its next await
                out.append((key, Outcome(timed_out=True)))
        return out

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s call, if one runs: its outcome is never handed back, and ``key`` may be submitted again."""
        call = self._calls.pop(key, None)
        if call is None:
            return
        if self._threads is not None:
            self._threads.abandon(call[0])
        else:
            call[0].cancel()

    def close(self) -> None:
        """Drop every call still running (their results are never read) and stop the workers."""
        for future, _ in self._calls.values():
            future.cancel()
        self._calls.clear()
        if self._threads is not None:
            self._threads.close()
        if self._events is not None:
            self._events.call_soon_threadsafe(self._events.stop)
