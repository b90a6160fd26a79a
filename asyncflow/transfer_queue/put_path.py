"""Controller request handlers of the put path: validate, place, reserve, commit or roll back.

A put is prepared (fields checked against the partition's schema, rows reserved, arena ranges
allocated on the storage units), the client writes the bytes, and the commit makes them visible. A put
that does not fit waits in ``parked_puts`` (back-pressure) until clears free space or its timeout
passes; one that is never committed is rolled back by the controller's timer. Every put names its
writer (a tag its client sends); ``roll_back_puts`` rolls back all pending puts of a writer whose
process died at once, so that its successor can put the same rows without waiting for their leases.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from .errors import (
    AlreadyWrittenError,
    BadRequestError,
    StalePutError,
    StorageUnitError,
    TransferQueueError,
    UnknownPartitionError,
    WritePendingError,
)
from .fencing import COPY_GRACE_S
from .partition import Partition
from .schema import FieldSpec
from .transport import DEFERRED, Request
from .validation import check_float, check_int, int_array

MAX_WRITER_CHARS = 256

_CLOSED_PUTS_KEPT = 1 << 16  # outcomes remembered for retries; a retry comes within seconds
_SPLIT_MIN_BYTES = 1 << 20  # puts smaller than this go to one unit: splitting costs more than it saves


@dataclass
class PendingPut:
    """A prepared put: rows reserved and ranges allocated, waiting for the client's commit."""

    partition: str
    rows: np.ndarray
    new_rows: bool
    fields: dict[str, tuple]  # name -> (spec, nbytes array, len0 array)
    blocks: list[int]
    meta: dict
    deadline: float
    writer: str = ""
    """The tag of the client that prepared it (``TransferQueueClient.writer``)."""


class PutHandlers:
    """Mixin of ``Controller``: the put path (uses its units, partitions, blocks and server)."""

    def _op_prepare_put(self, req: Request):
        result = self._try_prepare(req)
        if result is not None:
            return result
        timeout = check_float(req.header, "timeout", self.config.put_timeout_s)
        self.parked_puts.append((req, time.monotonic() + timeout))
        return DEFERRED

    def _try_prepare(self, req: Request):
        """Validate and reserve; None means 'valid but no capacity yet' (the caller parks it)."""
        h = req.header
        part = self._partition(h.get("partition"))
        count = check_int(h, "count", 1)
        writer = _writer(h, required=False)
        specs = self._check_put_fields(part, h.get("fields"), count)
        indexes = h.get("indexes")
        meta = {k: int_array(h.get(k), count, k) for k in ("versions", "group_ids", "lengths")}
        if indexes is None:
            if self.config.max_rows and count > self.config.max_rows:
                raise BadRequestError(f"a put of {count} rows can never fit under max_rows="
                                      f"{self.config.max_rows}")
            if self.config.max_rows and self.live_rows + count > self.config.max_rows:
                return None
            if part.sealed:
                raise BadRequestError(f"partition {part.name!r} is sealed; no new rows can be added")
            rows = None
        else:
            rows = int_array(indexes, count, "indexes")
            part.check_rows(rows)
            if part.lost[rows].any():
                raise self._lost_error(part)
            for name in specs:
                f = part.fields.get(name)
                if f is not None:
                    dup = rows[f.produced[rows] | f.pending[rows]]
                    if len(dup):
                        pending = bool(f.pending[dup].any())
                        raise (WritePendingError if pending else AlreadyWrittenError)(
                            f"field {name!r} was already written to rows {dup[:8].tolist()} of partition "
                            f"{part.name!r}{' (by a put not committed yet)' if pending else ''}; fields are "
                            "write-once")
        put_id = next(self._ids)
        placement = self._allocate(specs, count, put_id)
        if placement is None:
            return None
        if rows is None:
            rows = part.add_rows(count)
            self.live_rows += count
        chunks = []
        blocks = []
        for unit_id, start, stop, offsets in placement:
            chunk_offsets = {}
            for name, (block_id, offset) in offsets.items():
                f = part.field(name)
                if f.spec is None:
                    f.spec = specs[name][0]
                nbytes = specs[name][1][start:stop]
                sub = rows[start:stop]
                f.pending[sub] = True
                f.unit[sub] = unit_id
                f.offset[sub] = offset + np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
                f.nbytes[sub] = nbytes
                f.len0[sub] = specs[name][2][start:stop]
                f.block[sub] = block_id
                blocks.append(block_id)
                chunk_offsets[name] = offset
            chunks.append([unit_id, start, stop, chunk_offsets])
        deadline = time.monotonic() + self.config.put_lease_s
        self.puts[put_id] = PendingPut(part.name, rows, indexes is None, specs, blocks, meta, deadline, writer)
        self._epoch_high = put_id
        # The put id is the epoch of its ranges: writes carry it, and units refuse it once it is closed.
        return {"put": put_id, "indexes": rows.tolist(), "chunks": chunks, "lease": self.config.put_lease_s,
                "units": self._incarnations(c[0] for c in chunks)}

    def _check_put_fields(self, part: Partition, fields, count: int) -> dict[str, tuple]:
        if not isinstance(fields, dict) or not fields:
            raise BadRequestError("a put needs at least one field")
        specs = {}
        for name, desc in fields.items():
            part.check_field_name(name)
            if not isinstance(desc, (list, tuple)) or len(desc) != 3:
                raise BadRequestError(f"field {name!r}: malformed description")
            spec = FieldSpec.from_wire(desc[0])
            # Dense and ragged row sizes follow from the spec; only object fields send byte sizes.
            len0 = (np.zeros(count, np.int64) if desc[2] is None
                    else int_array(desc[2], count, f"{name} lengths"))
            if spec.kind == "object":
                nbytes = int_array(desc[1], count, f"{name} sizes")
                if nbytes is None:
                    raise BadRequestError(f"field {name!r}: object fields need their row sizes")
            elif desc[1] is not None:
                raise BadRequestError(f"field {name!r}: row sizes are only sent for object fields")
            else:
                nbytes = None
            if (nbytes is not None and np.any(nbytes < 0)) or np.any(len0 < 0):
                raise BadRequestError(f"field {name!r}: negative sizes")
            existing = part.fields[name].spec if name in part.fields else None
            if existing is not None and existing != spec:
                if (existing.kind == "ragged" and spec.kind == "dense" and spec.shape
                        and spec.shape[1:] == existing.shape and spec.dtype == existing.dtype):
                    # Equal-length rows given as one tensor to a ragged field: fine, rows of len shape[0].
                    len0 = np.full(count, spec.shape[0], np.int64)
                    spec = existing
                else:
                    raise BadRequestError(f"field {name!r} of partition {part.name!r} is "
                                          f"{existing.describe()}, but this put has {spec.describe()}")
            if nbytes is None:
                nbytes = _expected_nbytes(spec, len0)
            specs[name] = (spec, nbytes, len0)
        return specs

    def _allocate(self, specs: dict[str, tuple], count: int, epoch: int):
        """Place rows on units: [(unit, start, stop, {field: (block, offset)})], or None if full."""
        # Least used first; ties by id, so placement does not depend on the order units registered in.
        units = sorted((u for u in self.units.values() if u.alive), key=lambda u: (u.alloc.used, u.id))
        if not units:
            raise StorageUnitError("no storage unit is alive")
        row_bytes = sum(s[1] for s in specs.values())
        total = int(row_bytes.sum())
        if total > max(u.size for u in units):
            k = len(units)
        else:
            k = 1 if total < _SPLIT_MIN_BYTES or count < 2 else min(len(units), count)
        cum = np.cumsum(row_bytes)
        inner = [int(np.searchsorted(cum, total * i / k, side="left")) + 1 for i in range(1, k)]
        cuts = [0, *inner, count]
        cuts = sorted(set(min(max(c, 0), count) for c in cuts))
        placement, done = [], []
        for unit, (start, stop) in zip(units, itertools.pairwise(cuts)):
            offsets = {}
            for name, (_, nbytes, _) in specs.items():
                size = int(nbytes[start:stop].sum())
                if size > unit.size:
                    self._free_blocks(done, unused=True)
                    raise BadRequestError(f"field {name!r}: {size} bytes can never fit in a storage unit "
                                          f"of {unit.size} bytes; raise storage_unit_capacity_bytes")
                offset = unit.alloc.alloc(size)
                if offset is None:
                    self._free_blocks(done, unused=True)
                    return None
                block_id = next(self._ids)
                self.blocks[block_id] = [unit.id, offset, size, stop - start, epoch]
                done.append(block_id)
                offsets[name] = (block_id, offset)
            placement.append((unit.id, start, stop, offsets))
        return placement

    def _free_blocks(self, block_ids, unused: bool = False, not_before: float = 0.0) -> None:
        """Free blocks: at once when no writer ever saw them (``unused``), else through a fence."""
        for block_id in block_ids:
            block = self.blocks.pop(block_id, None)
            if block is None:
                continue
            unit = self.units.get(block[0])
            if unit is None or not unit.alive:
                continue
            if unused:
                unit.alloc.free(block[1], block[2])
            else:
                self._retire(block, not_before)

    def _op_commit_put(self, req: Request):
        put_id = req.header.get("put")
        put = self.puts.get(put_id)
        if put is None:
            closed = self.closed_puts.get(put_id) if isinstance(put_id, int) else None
            if closed is None:
                raise BadRequestError(f"unknown put {put_id!r}")
            if closed[0] == "committed":
                return closed[1]  # a retry after a lost reply: the first answer, nothing twice
            raise StalePutError(f"put {put_id} was rolled back before its commit ({closed[1]}); none of "
                                "its rows or fields are visible and its ranges are fenced; put the data again")
        if time.monotonic() > put.deadline:
            self._abort(put_id, f"its lease of {self.config.put_lease_s:g} s expired before the commit",
                        by_writer=False)
            return self._op_commit_put(req)
        part = self.partitions.get(put.partition)
        if part is None or part.lost[put.rows].any():
            self._abort(put_id, "its partition was cleared, or its rows were lost with a storage unit")
            raise self._lost_error(part) if part is not None else UnknownPartitionError(
                f"partition {put.partition!r} was cleared during the put")
        del self.puts[put_id]
        rows = put.rows
        for name in put.fields:
            f = part.fields[name]
            f.pending[rows] = False
            f.produced[rows] = True
        for key, arr in (("versions", part.versions), ("group_ids", part.group_ids),
                         ("lengths", part.lengths)):
            if put.meta[key] is not None:
                arr[rows] = put.meta[key]
        if put.meta["lengths"] is None:
            ragged = [s for s in put.fields.values() if s[0].kind == "ragged"]
            if ragged:
                unset = part.lengths[rows] == 0
                part.lengths[rows[unset]] = ragged[0][2][unset]
        part.on_produced(rows, list(put.fields))
        self._wake_gets(part.name)
        reply = {"indexes": rows.tolist()}
        self._close_put(put_id, ("committed", reply))
        return reply

    def _close_put(self, put_id: int, outcome: tuple) -> None:
        self.closed_puts[put_id] = outcome
        while len(self.closed_puts) > _CLOSED_PUTS_KEPT:
            self.closed_puts.popitem(last=False)

    def _op_abort_put(self, req: Request):
        self._abort(req.header.get("put"), "its writer aborted it")
        return {}

    def _op_roll_back_puts(self, req: Request):
        """Roll back every pending put of a writer declared dead, and drop its puts still waiting for capacity.

        Its rows are free at once; its ranges are fenced as for a lease expiry (``by_writer=False``), so
        that a copy of it still under way, or a late commit, never reaches the rows' next writer."""
        writer = _writer(req.header, required=True)
        reason = f"its writer {writer!r} was declared dead"
        put_ids = [k for k, put in self.puts.items() if put.writer == writer]
        for put_id in put_ids:
            self._abort(put_id, reason, by_writer=False)
        parked = [item for item in self.parked_puts if item[0].header.get("writer") == writer]
        for item in parked:
            self.parked_puts.remove(item)
            self.server.reply_error(item[0], StalePutError(f"put to partition {item[0].header.get('partition')!r} "
                                                           f"dropped before it was prepared: {reason}"))
        if parked:
            self._wake_puts()  # a put waiting behind the dropped ones may fit now
        return {"rolled_back": len(put_ids), "parked": len(parked)}

    def _abort(self, put_id, reason: str, by_writer: bool = True) -> None:
        """Roll back a pending put. ``by_writer``: its own client asked, so no copy of it can still be
        running on this host; otherwise its ranges wait out the lease before they are reused."""
        put = self.puts.pop(put_id, None)
        if put is None:
            return
        self._close_put(put_id, ("aborted", reason))
        part = self.partitions.get(put.partition)
        if part is not None:
            for name in put.fields:
                f = part.fields[name]
                f.pending[put.rows] = False
                f.block[put.rows] = -1
            if put.new_rows:
                part.roll_back_rows(put.rows)
                self.live_rows -= len(put.rows)
                if part.sealed:  # the rows a sealed partition's consumers waited for are gone
                    self._wake_gets(part.name)
        self._free_blocks(put.blocks, not_before=0.0 if by_writer else put.deadline + COPY_GRACE_S)
        self._wake_puts()

    def _wake_puts(self) -> None:
        for item in list(self.parked_puts):
            req = item[0]
            try:
                result = self._try_prepare(req)
            except TransferQueueError as exc:
                self.parked_puts.remove(item)
                self.server.reply_error(req, exc)
                continue
            if result is None:
                break  # FIFO: later puts must not overtake an earlier one that still does not fit
            self.parked_puts.remove(item)
            self.server.reply_ok(req, **result)

    def _capacity_text(self) -> str:
        units = ", ".join(f"unit {u.id}: {u.alloc.used >> 20}/{u.size >> 20} MiB"
                          for u in self.units.values())
        cap = f"/{self.config.max_rows}" if self.config.max_rows else ""
        rows = f"{self.live_rows}{cap} rows"
        return f"{rows}; {units}"

def _writer(header: dict, required: bool) -> str:
    """The writer tag of a request ("" when an optional one is absent)."""
    writer = header.get("writer")
    if writer is None and not required:
        return ""
    if not isinstance(writer, str) or not writer or len(writer) > MAX_WRITER_CHARS:
        raise BadRequestError(f"writer must be a non-empty string of at most {MAX_WRITER_CHARS} characters")
    return writer


def _expected_nbytes(spec: FieldSpec, len0: np.ndarray) -> np.ndarray | None:
    if spec.kind == "object":
        return None
    row = spec.inner_numel * spec.itemsize
    if spec.kind == "dense":
        return np.full(len(len0), row, np.int64)
    return len0 * row
