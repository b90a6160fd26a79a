"""Controller request handlers of the get path: sampling, DP/MP dispatch and waiting.

``get_meta`` runs the request's sampler over the rows ready for (task, fields); the rows are marked
handed out and their locations returned. A request that cannot be served yet is parked and retried
whenever its partition changes, until its timeout produces an error that says what was missing. All
model-parallel ranks of one DP replica receive the same batch: the first rank to ask samples it and
the others are served the cached copy.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .errors import (
    BadRequestError,
    ReadCancelledError,
    TransferQueueError,
    TransferQueueTimeoutError,
    UnknownPartitionError,
)
from .partition import Partition
from .samplers import Sampler, make_sampler
from .transport import DEFERRED, Request
from .validation import check_float, check_int

_READERS_KEPT = 1 << 16  # reader tags (and clients declared dead) remembered; old ones fall off the front


@dataclass
class ParkedGet:
    req: Request
    partition: str
    task: str
    fields: tuple[str, ...]
    batch_size: int
    sampler: Sampler
    dp: tuple[int, int, int, int]  # dp_rank, dp_size, mp_rank, mp_size
    allow_partial: bool
    deadline: float
    timeout: float
    lease: float
    reader: str | None = None  # the client's tag (its writer tag), named by ``cancel_reads``
    client: str | None = None  # the client's request-id prefix: one client object, one process

@dataclass
class ReplicaBatches:
    """Batches already sampled for one DP replica (or for all, with a joint sampler), so that every
    model-parallel rank of the replica receives the same rows."""

    batches: dict[int, list] = field(default_factory=dict)  # seq -> [signature, parts, remaining]
    next_seq: dict[tuple[int, int], int] = field(default_factory=dict)


class GetHandlers:
    """Mixin of ``Controller``: the get path (uses its partitions, replicas, parked_gets and server)."""

    reader_clients: OrderedDict[str, str]  # reader tag -> the client (request-id prefix) that last got under it
    cancelled_clients: OrderedDict[str, None]  # clients whose reads were cancelled (``cancel_reads``)

    def _op_get_meta(self, req: Request):
        h = req.header
        part = self._partition(h.get("partition"))
        task = h.get("task")
        if not isinstance(task, str) or not task:
            raise BadRequestError("task must be a non-empty string")
        fields = h.get("fields")
        if not isinstance(fields, list) or not fields:
            raise BadRequestError("a request needs a non-empty list of fields")
        for name in fields:
            part.check_field_name(name)
        batch_size = h.get("batch_size")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise BadRequestError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        sampler = make_sampler(h.get("sampler", "sequential"), h.get("sampler_args"))
        sampler.check(batch_size)
        dp = tuple(check_int(h, k, 0 if k.endswith("rank") else 1, default=0 if k.endswith("rank") else 1)
                   for k in ("dp_rank", "dp_size", "mp_rank", "mp_size"))
        if dp[0] >= dp[1] or dp[2] >= dp[3]:
            raise BadRequestError(f"need dp_rank < dp_size and mp_rank < mp_size, got {dp}")
        timeout = h.get("timeout")
        timeout = None if timeout is None else check_float(h, "timeout", 0.0)
        lease = check_float(h, "lease", self.config.row_lease_s)
        if lease <= 0:
            raise BadRequestError("lease must be > 0")
        reader, client = self._reader(req)
        p = ParkedGet(req, part.name, task, tuple(dict.fromkeys(fields)), batch_size, sampler, dp,
                      bool(h.get("allow_partial")), time.monotonic() + (timeout or 0.0), timeout or 0.0, lease,
                      reader, client)
        result = self._try_get(p)
        if result is not None:
            return result
        if not timeout:
            view = part.view(task, tuple(sorted(p.fields)))
            return {"indexes": [], "done": False, "ready": len(view.ready), "fields": {}}
        self.parked_gets.append(p)
        return DEFERRED

    def _reader(self, req: Request) -> tuple[str | None, str | None]:
        """The reader tag and client of a get; refuses a get of a client declared dead (``cancel_reads``): a
        request it sent before it died may arrive after the cancel."""
        reader, rid = req.header.get("reader"), req.header.get("rid")
        if reader is not None and not (isinstance(reader, str) and 0 < len(reader) <= 256):
            raise BadRequestError("reader must be a non-empty string of at most 256 characters")
        client = (rid.rpartition(".")[0] or None) if isinstance(rid, str) else None
        if client is not None and client in self.cancelled_clients:
            raise ReadCancelledError(f"the reads of {reader!r} were cancelled: its client was declared dead")
        if reader is not None and client is not None:
            self.reader_clients[reader] = client
            self.reader_clients.move_to_end(reader)
            while len(self.reader_clients) > _READERS_KEPT:
                self.reader_clients.popitem(last=False)
        return reader, client

    def _op_cancel_reads(self, req: Request):
        """Drop every parked get of a reader declared dead (its process is gone: nothing reads the answer), so
        that rows that come later, or that are released after this, go to live readers only. Its client's gets
        that arrive later are refused; a new client under the same tag (its restarted successor) reads as any."""
        reader = req.header.get("reader")
        if not isinstance(reader, str) or not reader:
            raise BadRequestError("cancel_reads needs the reader's tag")
        dropped = [p for p in self.parked_gets if p.reader == reader]
        dead = {p.client for p in dropped if p.client is not None}
        if reader in self.reader_clients:
            dead.add(self.reader_clients.pop(reader))
        for client in dead:
            self.cancelled_clients[client] = None
            while len(self.cancelled_clients) > _READERS_KEPT:
                self.cancelled_clients.popitem(last=False)
        for p in dropped:
            self.parked_gets.remove(p)
            self.server.reply_error(p.req, ReadCancelledError(
                f"get of task {p.task!r} on partition {p.partition!r} cancelled: its reader {reader!r} was declared "
                "dead"))
        return {"cancelled": len(dropped)}

    def _try_get(self, p: ParkedGet):
        part = self.partitions.get(p.partition)
        if part is None:
            raise UnknownPartitionError(f"partition {p.partition!r} was cleared")
        # Rows lost with a dead storage unit never go out (they left every ready view); the rest of the
        # partition stays readable, and replies say how many rows were lost.
        dp_rank, dp_size, mp_rank, mp_size = p.dp
        joint = p.sampler.joint_dp and dp_size > 1
        if mp_size == 1 and not joint:
            sampled = self._sample(part, p, p.batch_size, readers=1)
            return None if sampled is None else self._meta_reply(part, p, *sampled)
        key = (part.name, p.task, "joint" if joint else dp_rank)
        rb = self.replicas.setdefault(key, ReplicaBatches())
        member = (dp_rank, mp_rank)
        seq = rb.next_seq.get(member, 0)
        signature = [p.fields, p.batch_size, p.sampler.name]
        entry = rb.batches.get(seq)
        if entry is None:
            # Each row goes to the mp_size ranks of one replica: all of them must ack it before it is read.
            sampled = self._sample(part, p, p.batch_size * (dp_size if joint else 1), readers=mp_size)
            if sampled is None:
                return None
            rows, handout = sampled
            parts = p.sampler.split(rows, part.lengths[rows], dp_size) if joint else [rows]
            entry = rb.batches[seq] = [signature, parts, mp_size * (dp_size if joint else 1), handout]
        elif entry[0] != signature:
            raise BadRequestError(f"rank (dp {dp_rank}, mp {mp_rank}) of task {p.task!r} asked for "
                                  f"{signature}, but its replica's batch {seq} was {entry[0]}; all ranks "
                                  "of a replica must make the same requests")
        rb.next_seq[member] = seq + 1
        entry[2] -= 1
        if entry[2] == 0:
            del rb.batches[seq]
        return self._meta_reply(part, p, entry[1][dp_rank if joint else 0], entry[3])

    def _sample(self, part: Partition, p: ParkedGet, n: int, readers: int) -> tuple[list[int], int] | None:
        view = part.view(p.task, tuple(sorted(p.fields)))
        rows = p.sampler.select(view, n)
        if len(rows) < n and not (rows and p.allow_partial):
            if not part.sealed or part.remaining_unready(p.task, view.fields) > 0:
                return None  # more rows can still come: wait
            if not rows and part.in_flight_count(p.task):
                # Not done while rows of this task are out: an ack finishes them, or their lease ends and
                # they come back. (Answering "done" here lost the rows of a consumer that died.)
                return None
        handout = next(self._ids)
        if rows:
            lease_end = time.monotonic() + p.lease
            part.hand_out(p.task, rows, readers, handout, lease_end)
            heapq.heappush(self.leases, (lease_end, handout, part.name, p.task, np.asarray(rows, np.int64)))
        return rows, handout

    def _op_renew(self, req: Request):
        """Extend the lease of rows a consumer still works on (long steps); stale hand-outs renew nothing."""
        h = req.header
        part = self._partition(h.get("partition"))
        task = h.get("task")
        handout = check_int(h, "handout", 0)
        lease = check_float(h, "lease", self.config.row_lease_s)
        rows = part.renew(task, self._rows_arg(part, h.get("indexes")), handout, time.monotonic() + lease)
        if len(rows):
            heapq.heappush(self.leases, (time.monotonic() + lease, handout, part.name, task, rows))
        return {"renewed": len(rows)}

    def _expire_leases(self, now: float) -> None:
        """Rows whose consumer neither acked nor renewed in time go back to their task."""
        woken = set()
        while self.leases and self.leases[0][0] <= now:
            _, handout, name, task, rows = heapq.heappop(self.leases)
            part = self.partitions.get(name)
            if part is None or not part.expire_leases(task, rows, handout, now):
                continue
            # Cached replica batches would hand the returned rows out again without sampling; drop them.
            for key in [k for k in self.replicas if k[0] == name and k[1] == task]:
                del self.replicas[key]
            woken.add(name)
        for name in woken:
            self._wake_gets(name)

    def _meta_reply(self, part: Partition, p: ParkedGet, rows: list[int], handout: int):
        idx = np.asarray(rows, np.int64)
        fields = {}
        units = set()
        for name in p.fields:
            f = part.fields.get(name)
            if f is None:
                # A final, empty reply ("done") can name a field no row ever got: the rows that were to
                # get it were lost with a dead unit or cleared. Nothing to locate.
                fields[name] = [None, [], [], [], []]
                continue
            on = f.unit[idx].tolist()
            units.update(on)
            fields[name] = [f.spec.to_wire(), on, f.offset[idx].tolist(), f.nbytes[idx].tolist(),
                            f.len0[idx].tolist()]
        return {"indexes": idx.tolist(), "done": not rows, "fields": fields, "handout": handout,
                "lease": p.lease, "lost_rows": part.lost_rows, "versions": part.versions[idx].tolist(),
                "group_ids": part.group_ids[idx].tolist(), "units": self._incarnations(units),
                "lengths": part.lengths[idx].tolist()}

    def _wake_gets(self, name: str) -> None:
        for p in list(self.parked_gets):
            if p.partition != name:
                continue
            try:
                result = self._try_get(p)
            except TransferQueueError as exc:
                self.parked_gets.remove(p)
                self.server.reply_error(p.req, exc)
                continue
            if result is not None:
                self.parked_gets.remove(p)
                self.server.reply_ok(p.req, **result)

    def _timeout_error(self, p: ParkedGet) -> TransferQueueTimeoutError:
        part = self.partitions.get(p.partition)
        if part is None:
            return TransferQueueTimeoutError(f"task {p.task!r}: partition {p.partition!r} is gone")
        fields = tuple(sorted(p.fields))
        ready = len(part.view(p.task, fields).ready)
        missing = {k: v for k, v in part.missing_summary(p.task, fields).items() if v}
        missing_text = ", ".join(f"{k} (missing in {v} rows)" for k, v in missing.items()) or "none"
        return TransferQueueTimeoutError(
            f"task {p.task!r} timed out after {p.timeout:g} s waiting for {p.batch_size} rows of partition "
            f"{p.partition!r} with fields {list(p.fields)} (sampler {p.sampler.name!r}): {ready} rows ready "
            f"and unconsumed; fields still missing: {missing_text}; partition has {part.live_rows} live "
            f"rows{', sealed' if part.sealed else ''}"
            + (f"; {part.lost_rows} rows were lost with a dead storage unit" if part.lost_rows else ""))
