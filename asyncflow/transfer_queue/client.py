"""Synchronous TransferQueue client, and the request building it shares with the asyncio client.

A put is three steps: ``prepare_put`` (the controller checks the fields and says where each row's
bytes go), the bytes go to the storage units (a memcpy into the mapped arena on the same host, a
``write`` message otherwise), and ``commit_put`` makes the fields visible. A get is ``get_meta`` (rows
and locations) followed by reading the bytes and a one-way ``ack``. Any failure between prepare and
commit aborts the put, so a failed put leaves nothing behind. A writer killed in between cannot abort:
its puts name it (``writer``), and whoever sees it die rolls them back with ``roll_back_puts``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import zmq

from .batch import Batch, BatchMeta
from .codec import EncodedField, copy_bytes, encode_field, finish_output, new_output
from .config import TransferQueueConfig
from .errors import BadRequestError, ServerUnavailableError, StalePutError, TransferQueueError
from .protocol import RequestIds, Signer
from .schema import FieldSpec
from .shm import Arena, can_open, host_id
from .transport import Connection

_RPC_GRACE_S = 5.0  # a parked request's reply may arrive this long after its server-side timeout
_LEASE_MARGIN_S = 0.5
_COMMIT_TRIES = 3


# --------------------------------------------------------------------- shared request building
def encode_put(data: dict, indexes, versions, group_ids, lengths) -> tuple[dict[str, EncodedField], int]:
    """Encode every field of a put and check that they agree on the number of rows."""
    if not isinstance(data, dict) or not data:
        raise BadRequestError("put needs a non-empty dict of fields")
    encoded = {}
    for name, value in data.items():
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"field names must be non-empty strings, got {name!r}")
        encoded[name] = encode_field(name, value)
    counts = {name: e.num_rows for name, e in encoded.items()}
    count = next(iter(counts.values()))
    if len(set(counts.values())) != 1:
        raise BadRequestError(f"fields of one put must have the same number of rows, got {counts}")
    if count == 0:
        raise BadRequestError("a put needs at least one row")
    for what, value in (("indexes", indexes), ("versions", versions), ("group_ids", group_ids),
                        ("lengths", lengths)):
        if value is not None and len(value) != count:
            raise BadRequestError(f"{what} has {len(value)} entries for {count} rows")
    return encoded, count


def _ints(value):
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value]


def put_header(partition: str, encoded: dict[str, EncodedField], count: int, indexes, versions,
               group_ids, lengths, timeout: float, writer: str | None = None) -> dict:
    # Dense and ragged row sizes follow from spec and lengths; only object rows need explicit sizes.
    fields = {name: [e.spec.to_wire(), e.row_nbytes.tolist() if e.spec.kind == "object" else None,
                     None if e.row_len0 is None else e.row_len0.tolist()] for name, e in encoded.items()}
    return {"op": "prepare_put", "partition": partition, "count": count, "fields": fields,
            "indexes": _ints(indexes), "versions": _ints(versions), "group_ids": _ints(group_ids),
            "lengths": _ints(lengths), "timeout": timeout, "writer": writer}


def writer_tag(writer: str | None, rids: RequestIds) -> str:
    """A client's writer tag: the one it was given, or one unique to it."""
    if writer is None:
        return f"client-{rids.prefix}"
    if not isinstance(writer, str) or not writer:
        raise BadRequestError(f"writer must be a non-empty string, got {writer!r}")
    return writer


def write_plan(chunks: list, encoded: dict[str, EncodedField]) -> dict[int, list[tuple[int, memoryview]]]:
    """unit -> [(arena offset, bytes)] for the placement the controller chose."""
    plan: dict[int, list] = {}
    for unit, start, stop, offsets in chunks:
        items = plan.setdefault(unit, [])
        for name, offset in offsets.items():
            pos = offset
            for piece in encoded[name].row_range_pieces(start, stop):
                if piece.nbytes:
                    items.append((pos, piece))
                pos += piece.nbytes
    return plan


def lease_deadline(reply: dict) -> float:
    """Local monotonic time after which this client must not write into a prepared put's ranges.

    The controller's lease started before its reply left; a margin covers the reply's transit."""
    return time.monotonic() + float(reply.get("lease", 0.0)) - _LEASE_MARGIN_S


def check_lease(put_id: int, lease_end: float) -> None:
    if time.monotonic() >= lease_end:
        raise StalePutError(f"the lease of put {put_id} ran out before its bytes were written; it is being "
                            "rolled back (raise put_lease_s for very large or slow puts)")


class ReadPlan:
    """Output buffers for the fields of a batch and the byte ranges that fill them."""

    def __init__(self, meta: BatchMeta, fields: list[str] | None):
        names = meta.fields if fields is None else list(fields)
        unknown = [n for n in names if n not in meta.locations]
        if unknown:
            raise BadRequestError(f"unknown field(s) {unknown}; this batch has {meta.fields}")
        self.fields = {}
        self.unwritten: list[str] = []  # fields no row of the partition ever got (only in an empty reply)
        self.by_unit: dict[int, list[tuple[int, int, memoryview]]] = {}
        for name in names:
            spec_wire, units, offsets, nbytes, len0 = meta.locations[name]
            if spec_wire is None and not len(units):
                self.unwritten.append(name)
                continue
            spec = FieldSpec.from_wire(spec_wire)
            units, offsets = np.asarray(units, np.int64), np.asarray(offsets, np.int64)
            nbytes, len0 = np.asarray(nbytes, np.int64), np.asarray(len0, np.int64)
            out, dst = new_output(spec, len0, int(nbytes.sum()))
            self.fields[name] = (spec, out, dst, nbytes, len0)
            if not len(units):
                continue
            # Coalesce rows that are adjacent in the same arena: one copy per run instead of per row.
            cut = np.flatnonzero((units[1:] != units[:-1]) | (offsets[1:] != offsets[:-1] + nbytes[:-1])) + 1
            starts = np.concatenate(([0], cut))
            stops = np.concatenate((cut, [len(units)]))
            dst_pos = np.concatenate(([0], np.cumsum(nbytes)))
            for a, b in zip(starts.tolist(), stops.tolist()):
                size = int(dst_pos[b] - dst_pos[a])
                if size:
                    self.by_unit.setdefault(int(units[a]), []).append(
                        (int(offsets[a]), size, dst[int(dst_pos[a]):int(dst_pos[b])]))

    def finish(self, meta: BatchMeta, ragged: str) -> Batch:
        data = {name: finish_output(spec, out, dst, nbytes, len0, ragged)
                for name, (spec, out, dst, nbytes, len0) in self.fields.items()}
        data.update((name, []) for name in self.unwritten)
        return Batch(meta, data)


def get_header(partition: str, task: str, fields, batch_size: int, sampler: str, sampler_args,
               dp_rank: int, dp_size: int, mp_rank: int, mp_size: int, timeout, allow_partial: bool,
               lease: float | None = None, reader: str | None = None) -> dict:
    """A ``get_meta`` request; ``reader``: the client's tag, which ``cancel_reads`` names."""
    if isinstance(fields, str):
        fields = [fields]
    return {"op": "get_meta", "partition": partition, "task": task, "fields": list(fields),
            "batch_size": batch_size, "sampler": sampler, "sampler_args": sampler_args or {},
            "dp_rank": dp_rank, "dp_size": dp_size, "mp_rank": mp_rank, "mp_size": mp_size,
            "timeout": timeout, "allow_partial": allow_partial, "lease": lease, "reader": reader}


def ack_header(meta: BatchMeta) -> dict:
    """One-way ack of a batch's rows, naming its hand-out (an ack of an older hand-out is ignored)."""
    return {"op": "ack", "partition": meta.partition, "task": meta.task, "indexes": meta.indexes,
            "handout": meta.handout, "noreply": True}


def check_ragged(ragged: str) -> None:
    if ragged not in ("list", "packed"):
        raise BadRequestError(f"ragged must be 'list' or 'packed', got {ragged!r}")


class UnitHandle:
    """How a client reaches one storage unit: its mapped arena (same host) and/or a connection."""

    def __init__(self, uid: int, address: str, arena_name: str | None, size: int, use_shm: bool,
                 incarnation: int = 0, shm_host: str = ""):
        self.id = uid
        self.incarnation = incarnation
        self.address = address
        self.arena: Arena | None = None
        # Same host only by identity, not because a file of that name exists here: another host's /dev/shm
        # may hold a different segment of the same name.
        if use_shm and arena_name and shm_host == host_id() and can_open(arena_name):
            try:
                self.arena = Arena.attach(arena_name, size)
            except OSError:
                self.arena = None  # another /dev/shm namespace: fall back to messages
        self.conn = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.arena is not None:
            self.arena.close()


def refresh_units(units: dict[int, UnitHandle], listed: list, use_shm: bool) -> None:
    """Update a client's unit handles from ``hello``: a unit that registered again (it rejoined after
    being declared dead, or its process was restarted with a new arena) gets a new handle."""
    for uid, address, arena, size, _alive, incarnation, shm_host in listed:
        old = units.get(uid)
        if old is not None and old.incarnation == incarnation:
            continue
        if old is not None:
            old.close()
        units[uid] = UnitHandle(uid, address, arena, size, use_shm, incarnation, shm_host)


def stale_units(units: dict[int, UnitHandle], incarnations: dict | None) -> bool:
    """True when a reply names a unit this client does not know, or knows an older incarnation of."""
    return any(int(uid) not in units or units[int(uid)].incarnation != inc
               for uid, inc in (incarnations or {}).items())


# --------------------------------------------------------------------- the client
class TransferQueueClient:
    """Blocking client. Thread-safe (one request at a time per client; use one client per thread
    for parallelism)."""

    def __init__(self, address: str, config: TransferQueueConfig | None = None, *, writer: str | None = None):
        """``writer``: the tag every put and get of this client carries, so that its pending puts can be rolled
        back (``roll_back_puts``) and its waiting gets dropped (``cancel_reads``) when its process dies; None: a tag
        unique to this client."""
        self._rids = RequestIds()
        self.writer = writer_tag(writer, self._rids)
        """The tag sent with every put (its writer) and get (its reader)."""
        self.config = config or TransferQueueConfig()
        self.address = address
        self._ctx = zmq.Context()
        self._signer = Signer(self.config.secret)
        self._lock = threading.RLock()
        self._controller = Connection(self._ctx, address, self._signer, "controller",
                                      self.config.max_message_bytes)
        # Blocking gets wait on a connection of their own thread, not under the client lock, so that a
        # consumer parked for minutes never stalls the puts, acks or status calls of other threads.
        self._waiters = threading.local()
        self._waiter_conns: list[Connection] = []
        self._units: dict[int, UnitHandle] = {}
        self.moved_bytes = {"shm": 0, "socket": 0}
        """Payload bytes this client put and got through mapped arenas (same host) and through sockets."""
        self._closed = False
        self._hello()

    # ------------------------------------------------------------- plumbing
    def _call(self, header: dict, timeout_s: float | None = None, buffers=(), conn=None) -> dict:
        conn = conn or self._controller
        return conn.request(self._rids.stamp(header), buffers, timeout_s or self.config.rpc_timeout_s)[0]

    def _waiter(self) -> Connection:
        conn = getattr(self._waiters, "conn", None)
        if conn is None:
            with self._lock:
                if self._closed:
                    raise TransferQueueError("the client is closed")
                conn = Connection(self._ctx, self.address, self._signer, "controller",
                                  self.config.max_message_bytes)
                self._waiter_conns.append(conn)
            self._waiters.conn = conn
        return conn

    def _commit(self, put_id: int) -> list[int]:
        # A commit is idempotent (by put id and request id): when its reply is lost, ask again rather than
        # abort a put that may have been committed (the retry of the whole put would duplicate rows).
        header = self._rids.stamp({"op": "commit_put", "put": put_id})
        for attempt in range(_COMMIT_TRIES):
            try:
                return self._call(header)["indexes"]
            except ServerUnavailableError:
                if attempt == _COMMIT_TRIES - 1:
                    raise

    def _hello(self) -> None:
        deadline = time.monotonic() + self.config.rpc_timeout_s
        while True:
            reply = self._call({"op": "hello"})
            if reply.get("ready") or time.monotonic() > deadline:
                break
            time.sleep(0.02)  # storage units are still registering (start-up only)
        refresh_units(self._units, reply["units"], self.config.shm_enabled)
        if not self._units:
            raise ServerUnavailableError(f"the controller at {self.address} has no storage units")

    def _unit(self, uid: int) -> UnitHandle:
        if uid not in self._units:
            self._hello()
        unit = self._units.get(uid)
        if unit is None:
            raise TransferQueueError(f"storage unit {uid} is unknown to the controller")
        return unit

    def _conn(self, unit: UnitHandle) -> Connection:
        if unit.conn is None:
            unit.conn = Connection(self._ctx, unit.address, self._signer, f"storage unit {unit.id}",
                                   self.config.max_message_bytes)
        return unit.conn

    def _use_shm(self, unit: UnitHandle, nbytes: int) -> bool:
        return unit.arena is not None and nbytes >= self.config.shm_threshold_bytes

    # ------------------------------------------------------------- partitions
    def create_partition(self, partition: str, *, fields: list[str] | None = None,
                         consumers: list[str] | None = None, expected_rows: int | None = None,
                         auto_clear: bool = False, exist_ok: bool = False) -> bool:
        """Create a partition (e.g. one global step). ``fields``: the only field names allowed (None:
        any). ``consumers``: tasks that must read every row before it may be cleared; with
        ``auto_clear`` rows are freed as soon as all of them have read them. ``expected_rows``: the
        partition seals itself when that many rows exist. Returns False if it existed (exist_ok)."""
        with self._lock:
            return self._call({"op": "create_partition", "partition": partition, "fields": fields,
                               "consumers": consumers, "expected_rows": expected_rows,
                               "auto_clear": auto_clear, "exist_ok": exist_ok})["created"]

    def seal(self, partition: str) -> int:
        """Declare that no new rows will be added; consumers then get a final partial batch and
        ``done``. Returns the number of rows."""
        with self._lock:
            return self._call({"op": "seal", "partition": partition})["rows"]

    def clear(self, partition: str, indexes: list[int] | None = None, *, force: bool = False) -> int:
        """Free rows (or the whole partition). Refused while declared consumers have not read them or
        rows are handed out and unread, unless ``force``. Returns the number of rows cleared."""
        with self._lock:
            return self._call({"op": "clear", "partition": partition, "indexes": _ints(indexes),
                               "force": force})["cleared"]

    def status(self, partition: str | None = None) -> dict:
        """Production and consumption status: rows, fields produced, per task in flight / read /
        ready, storage usage, waiting requests."""
        with self._lock:
            reply = self._call({"op": "status", "partition": partition})
        return {k: reply[k] for k in ("partitions", "units", "live_rows", "parked_gets", "parked_puts",
                                      "pending_puts", "dropped_messages")}

    # ------------------------------------------------------------- put
    def put(self, partition: str, data: dict, *, indexes=None, versions=None, group_ids=None,
            lengths=None, timeout: float | None = None) -> list[int]:
        """Write fields. Without ``indexes`` new rows are appended; with them, the fields are added to
        existing rows. ``versions``/``group_ids``/``lengths`` set per-row metadata (lengths default to
        the first ragged field's row lengths). Waits up to ``timeout`` for capacity (back-pressure).
        Returns the rows' indexes."""
        timeout = self.config.put_timeout_s if timeout is None else timeout
        encoded, count = encode_put(data, indexes, versions, group_ids, lengths)
        header = put_header(partition, encoded, count, indexes, versions, group_ids, lengths, timeout, self.writer)
        with self._lock:
            reply = self._call(header, timeout + _RPC_GRACE_S)
            lease_end = lease_deadline(reply)
            try:
                if stale_units(self._units, reply.get("units")):
                    self._hello()
                self._write(write_plan(reply["chunks"], encoded), reply["put"], lease_end)
                return self._commit(reply["put"])
            except BaseException:
                self._abort(reply["put"])
                raise

    def roll_back_puts(self, writer: str) -> int:
        """Roll back every put of ``writer`` (another client's tag) that was prepared and not committed, and
        drop its puts still waiting for capacity: call it once that writer's process is dead and before its
        successor writes under the same tag. The rows those puts held are free at once; a late commit of one
        of them is refused (``StalePutError``) and its late writes never reach the rows' next writer. Returns
        how many puts it rolled back or dropped."""
        with self._lock:
            reply = self._call({"op": "roll_back_puts", "writer": writer})
        return reply["rolled_back"] + reply["parked"]

    def cancel_reads(self, reader: str) -> int:
        """Drop every get of ``reader`` (another client's tag) waiting in the controller, and refuse the gets its
        client sends later: call it once that reader's process is dead and before its rows are released, so that
        rows released or put after this go to live readers, not to a get nobody reads (which would hold them until
        ``row_lease_s``). A new client under the same tag (its successor) reads as any. Returns how many gets it
        dropped."""
        with self._lock:
            return self._call({"op": "cancel_reads", "reader": reader})["cancelled"]

    def _abort(self, put_id: int) -> None:
        try:
            self._call({"op": "abort_put", "put": put_id})
        except TransferQueueError:
            pass  # the controller expires uncommitted puts by itself

    def _write(self, plan: dict[int, list], put_id: int, lease_end: float) -> None:
        pending = []
        for uid, items in plan.items():
            unit = self._unit(uid)
            nbytes = sum(p.nbytes for _, p in items)
            self.moved_bytes["shm" if self._use_shm(unit, nbytes) else "socket"] += nbytes
            if self._use_shm(unit, nbytes):
                view = unit.arena.view
                for offset, piece in items:
                    check_lease(put_id, lease_end)  # never start a copy into a range that may be reused
                    copy_bytes(view[offset:offset + piece.nbytes], piece)
            else:
                conn = self._conn(unit)
                ranges = [[offset, piece.nbytes] for offset, piece in items]
                pending.append((conn, conn.send({"op": "write", "ranges": ranges, "epoch": put_id},
                                                [p for _, p in items])))
        for conn, req_id in pending:  # all units write in parallel; then wait for each
            conn.recv(req_id, self.config.rpc_timeout_s, "write")

    # ------------------------------------------------------------- get
    def get_meta(self, partition: str, task: str, fields, batch_size: int, *, sampler: str = "sequential",
                 sampler_args: dict | None = None, dp_rank: int = 0, dp_size: int = 1, mp_rank: int = 0,
                 mp_size: int = 1, block: bool = True, timeout: float | None = None,
                 allow_partial: bool = False, lease: float | None = None) -> BatchMeta:
        """Ask the controller for up to ``batch_size`` rows in which all ``fields`` are produced and
        that ``task`` has not received. The rows are marked handed out to ``task``. Blocks until a
        full batch is ready (or the partition is sealed and this is the last, partial one), raising
        TransferQueueTimeoutError after ``timeout``; ``block=False`` returns an empty meta at once."""
        timeout = self.config.get_timeout_s if timeout is None else timeout
        header = get_header(partition, task, fields, batch_size, sampler, sampler_args, dp_rank, dp_size,
                            mp_rank, mp_size, timeout if block else None, allow_partial, lease, self.writer)
        if block:
            reply = self._call(header, timeout + self.config.rpc_timeout_s, conn=self._waiter())
        else:
            with self._lock:
                reply = self._call(header)
        return BatchMeta.from_reply(partition, task, reply)

    def renew(self, meta: BatchMeta, lease: float | None = None) -> int:
        """Extend the lease of ``meta``'s rows (for consumers that hold rows longer than ``row_lease_s``
        before reading them). Returns how many rows were still leased to this hand-out."""
        if not meta.indexes:
            return 0
        with self._lock:
            return self._call({"op": "renew", "partition": meta.partition, "task": meta.task,
                               "indexes": meta.indexes, "handout": meta.handout, "lease": lease})["renewed"]

    def get_data(self, meta: BatchMeta, fields: list[str] | None = None, *, ragged: str = "list",
                 ack: bool = True) -> Batch:
        """Read the rows of ``meta`` from the storage units (all fields, or ``fields``); ragged fields
        come back as lists of tensors (``ragged="list"``) or as ``Packed`` (``"packed"``). ``ack=False``: the
        rows stay in flight under their lease until ``ack`` (a consumer that acks only once its output is
        put: rows of a consumer that dies before go back to the task)."""
        check_ragged(ragged)
        plan = ReadPlan(meta, fields)
        with self._lock:
            if stale_units(self._units, meta.units):
                self._hello()
            pending = []
            for uid, items in plan.by_unit.items():
                unit = self._unit(uid)
                nbytes = sum(size for _, size, _ in items)
                self.moved_bytes["shm" if self._use_shm(unit, nbytes) else "socket"] += nbytes
                if self._use_shm(unit, nbytes):
                    view = unit.arena.view
                    for offset, size, dst in items:
                        copy_bytes(dst, view[offset:offset + size])
                else:
                    conn = self._conn(unit)
                    req_id = conn.send({"op": "read", "ranges": [[o, s] for o, s, _ in items]})
                    pending.append((conn, req_id, items))
            for conn, req_id, items in pending:
                _, buffers = conn.recv(req_id, self.config.rpc_timeout_s, "read")
                if len(buffers) != len(items):
                    raise TransferQueueError(f"{conn.name} returned {len(buffers)} buffers for {len(items)}")
                for (_, _, dst), buf in zip(items, buffers):
                    dst[:] = memoryview(buf).cast("B")
            if meta.indexes and ack:
                self._controller.send(self._rids.stamp(ack_header(meta)))
        return plan.finish(meta, ragged)

    def ack(self, meta: BatchMeta, indexes: list[int] | None = None) -> None:
        """Mark the rows of ``meta`` (or those of them in ``indexes``) read, after ``get_data(..., ack=False)``.
        One-way; an ack of a hand-out whose rows were released or expired meanwhile is ignored."""
        header = ack_header(meta)
        if indexes is not None:
            header["indexes"] = [int(i) for i in indexes]
        if header["indexes"]:
            with self._lock:
                self._controller.send(self._rids.stamp(header))

    def get(self, partition: str, task: str, fields, batch_size: int, *, ragged: str = "list", ack: bool = True,
            **kwargs) -> Batch:
        """``get_meta`` then ``get_data``: a batch of up to ``batch_size`` rows (empty and ``done``
        when the sealed partition has nothing left for ``task``)."""
        check_ragged(ragged)
        return self.get_data(self.get_meta(partition, task, fields, batch_size, **kwargs), ragged=ragged, ack=ack)

    def poll(self, partition: str, task: str, fields, batch_size: int, *, ragged: str = "list",
             **kwargs) -> Batch | None:
        """Non-blocking ``get``: None when a batch is not ready yet."""
        meta = self.get_meta(partition, task, fields, batch_size, block=False, **kwargs)
        if not meta.indexes and not meta.done:
            return None
        return self.get_data(meta, ragged=ragged)

    def iter_batches(self, partition: str, task: str, fields, batch_size: int, *, ragged: str = "list",
                     **kwargs) -> Iterator[Batch]:
        """Yield micro-batches as rows become ready until the partition is sealed and exhausted for
        ``task`` (a timeout between two batches raises TransferQueueTimeoutError)."""
        while True:
            batch = self.get(partition, task, fields, batch_size, ragged=ragged, **kwargs)
            if batch.done:
                return
            yield batch

    def release(self, partition: str, task: str, indexes: list[int] | None = None) -> int:
        """Hand rows that ``task`` received but never read back (e.g. its worker died) to it again.
        Returns how many rows were released."""
        with self._lock:
            return self._call({"op": "release", "partition": partition, "task": task,
                               "indexes": _ints(indexes)})["released"]

    # ------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Close sockets and unmap arenas (tensors already returned stay valid)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._controller.close()
            for conn in self._waiter_conns:
                conn.close()
            for unit in self._units.values():
                unit.close()
            self._ctx.term()

    def __enter__(self) -> TransferQueueClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
