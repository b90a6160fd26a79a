"""The rows of a restartable rollout instance on the continuous stream (``asyncflow.workflow.rollout_stream``):
read without acking, acked once their responses are put, so that the supervisor can hand out again what an instance
that died held (``asyncflow.workflow.supervisor``)."""

from __future__ import annotations

import time

from asyncflow.workflow.partitions import partition_name


class RedoRows:
    """The rows of a rollout instance the driver restarts (``redo``): read without acking, and acked once their
    responses are put. The rows of an instance that dies stay in flight; the supervisor releases them and they
    are generated again from their prompts, by another instance or by its restarted self (a multi-turn
    trajectory, or a response partly generated across weight versions, starts again from its prompt)."""

    wait_s = 1.0
    """A blocking read's wait (the loop then looks at the other steps again). A read that a dead instance left
    waiting in the controller is dropped by the supervisor before it hands that instance's rows back
    (``cancel_reads``)."""

    def __init__(self, service, poll_s: float):
        self.svc, self.poll_s = service, poll_s
        self.holds: dict = {}  # (step, row) -> the meta of its newest hand-out to this instance (named by its ack)
        self.put: set = set()  # (step, row) this instance put, until its step is reported
        self.checked: dict[int, float] = {}  # step -> when its partition's status was last asked
        self.waiting_since: float | None = None  # the first of the blocking reads in a row that found nothing

    def read(self, step: int, fields: list[str], n: int, block: bool):
        """Up to ``n`` rows of ``step`` handed out to this instance, unacked (``done`` once every row of it is
        acked); None when none is ready (after ``wait_s`` when ``block``)."""
        from asyncflow.transfer_queue import TransferQueueTimeoutError

        tq, part = self.svc.tq, partition_name(step)
        try:
            meta = tq.get_meta(part, self.svc.name, fields, n, allow_partial=True, block=block, timeout=self.wait_s)
        except TransferQueueTimeoutError:  # nothing for ``step_timeout_s`` in all: the run is stuck
            self.waiting_since = self.waiting_since or time.monotonic()
            if time.monotonic() - self.waiting_since > self.svc.timeout_s:
                raise
            return None
        if not meta.indexes and not meta.done:
            return None
        self.waiting_since = None
        return tq.get_data(meta, ack=False)

    def take(self, step: int, batch) -> list[int]:
        """The positions of ``batch``'s rows to generate. A row handed out again while this instance still holds
        it (the supervisor released every in-flight row of the task when a peer died) keeps generating under its
        new hand-out; a row it already put is acked at once."""
        fresh, written = [], []
        for i, index in enumerate(batch.indexes):
            key = (step, index)
            if key in self.put:
                written.append(index)
                continue
            if key not in self.holds:
                fresh.append(i)
            self.holds[key] = batch.meta
        if written:
            self.svc.tq.ack(batch.meta, written)
        return fresh

    def written(self, step: int, indexes: list[int]) -> None:
        """The responses of ``indexes`` of ``step`` are put: ack each under its newest hand-out (an ack of a
        hand-out released meanwhile is ignored; the row's new holder acks it)."""
        by_handout: dict = {}
        for index in indexes:
            meta = self.holds.pop((step, index))
            by_handout.setdefault(meta.handout, (meta, []))[1].append(index)
            self.put.add((step, index))
        for meta, rows in by_handout.values():
            self.svc.tq.ack(meta, rows)

    def handed_out(self, step: int) -> bool:
        """Every row of ``step`` is fed and handed out (to this instance or another, or read): the stream admits
        the next step meanwhile, and ``_reopen`` takes the rows that come back. Asked at most every ``poll_s``."""
        now = time.monotonic()
        if now - self.checked.get(step, 0.0) < self.poll_s:
            return False
        self.checked[step] = now
        part = partition_name(step)
        status = self.svc.tq.status(part)["partitions"][part]
        task = status["tasks"].get(self.svc.name, {})
        return status["sealed"] and task.get("in_flight", 0) + task.get("read", 0) >= status["live_rows"] > 0

    def forget(self, step: int) -> None:
        """``step`` is reported: every row of it is acked, none comes back."""
        self.put = {key for key in self.put if key[0] != step}
        self.checked.pop(step, None)
