"""Controller-side state of one partition: which (row, field) is produced, which task consumed what.

Rows are numbered 0..n-1 within their partition (the row's global index). Per-row and per-field state
lives in numpy arrays so that status queries and first requests are vectorised. For every (task, set
of fields) that has asked for data, a ``ReadyView`` keeps the rows that are ready for it and not yet
handed out, updated incrementally on every put, hand-out, release and clear; a request therefore costs
O(batch) rather than O(partition), which is what keeps the metadata path well under a millisecond on
partitions of 100k rows.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .errors import BadRequestError, RowsClearedError
from .schema import FieldSpec

FREE, IN_FLIGHT, READ = 0, 1, 2  # per-task consumption state of a row
MAX_TASKS = 256  # consumer tasks per partition (each costs 19 bytes per row once it has rows handed out)
MAX_VIEWS_PER_TASK = 16  # field sets per task kept as ready views (each costs O(ready rows))


def _grow(arr: np.ndarray, size: int, fill) -> np.ndarray:
    out = np.full(size, fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


class FieldState:
    """Where each row's bytes of one field live and whether they exist yet."""

    ARRAYS = (("produced", bool, False), ("pending", bool, False), ("unit", np.int32, -1),
              ("offset", np.int64, 0), ("nbytes", np.int64, 0), ("len0", np.int64, 0),
              ("block", np.int64, -1))

    def __init__(self, name: str, capacity: int):
        self.name = name
        self.spec: FieldSpec | None = None  # fixed by the first write
        for attr, dtype, fill in self.ARRAYS:
            setattr(self, attr, np.full(capacity, fill, dtype=dtype))
        self.produced_count = 0

    def grow(self, capacity: int) -> None:
        for attr, _, fill in self.ARRAYS:
            setattr(self, attr, _grow(getattr(self, attr), capacity, fill))


class ReadyView:
    """Rows ready for one task and one set of fields, in the order they became ready."""

    def __init__(self, part: Partition, fields: tuple[str, ...]):
        self.part = part
        self.fields = fields
        # OrderedDict, not dict: rows leave from the front, and a plain dict would keep scanning the
        # holes they leave behind on every iteration (O(rows consumed so far) per request).
        self.ready: OrderedDict[int, None] = OrderedDict()
        self.by_group: OrderedDict[int, OrderedDict[int, None]] = OrderedDict()

    @property
    def versions(self) -> np.ndarray:
        return self.part.versions

    @property
    def lengths(self) -> np.ndarray:
        return self.part.lengths

    def add(self, rows, front: bool = False) -> None:
        """Make rows ready; ``front`` puts them before all others (released rows are oldest)."""
        rows = np.asarray(rows, np.int64)
        ready, by_group = self.ready, self.by_group
        pairs = list(zip(rows.tolist(), self.part.group_ids[rows].tolist()))
        for r, g in reversed(pairs) if front else pairs:
            ready[r] = None
            if front:
                ready.move_to_end(r, last=False)
            if g >= 0:
                members = by_group.get(g)
                if members is None:
                    members = by_group[g] = OrderedDict()
                members[r] = None
                if front:
                    members.move_to_end(r, last=False)
                    by_group.move_to_end(g, last=False)

    def remove(self, rows) -> None:
        rows = np.asarray(rows, np.int64)
        ready, by_group = self.ready, self.by_group
        for r, g in zip(rows.tolist(), self.part.group_ids[rows].tolist()):
            if ready.pop(r, 0) is None and g >= 0:  # was present (value None): drop from its group
                members = by_group.get(g)
                if members is not None:
                    members.pop(r, None)
                    if not members:
                        del by_group[g]


class TaskState:
    """Consumption record of one task in one partition.

    The per-row arrays are allocated at the task's first hand-out, not when it is first named: a get
    that finds nothing ready (a consumer parked on a partition it has not read yet, or a task that
    never reads this partition) costs a ready view and nothing per row. Until then every row is FREE."""

    ARRAYS = (("consumed", np.int8, FREE), ("readers", np.int16, 0), ("handout", np.int64, -1),
              ("lease_end", np.float64, 0.0))

    def __init__(self, capacity: int):
        # consumed: FREE / IN_FLIGHT / READ. readers: acks still owed for rows in flight (every
        # model-parallel rank of the replica reads the row, and it counts as read, and may be
        # auto-cleared, only after the last of them). handout: id of the hand-out a row in flight belongs
        # to, so that an ack or renewal of an older hand-out of the same row is recognised as stale.
        # lease_end: when a row in flight returns to the task unless acked or renewed.
        self.capacity = capacity
        self.consumed = self.readers = self.handout = self.lease_end = None
        self.views: dict[tuple[str, ...], ReadyView] = {}
        self.lease_expired = 0
        self.stale_acks = 0

    @property
    def allocated(self) -> bool:
        """Whether the task ever had rows handed out (and so holds per-row arrays)."""
        return self.consumed is not None

    def allocate(self) -> None:
        if self.consumed is None:
            for attr, dtype, fill in self.ARRAYS:
                setattr(self, attr, np.full(self.capacity, fill, dtype=dtype))

    def state_of(self, rows) -> np.ndarray:
        """``consumed`` of ``rows`` (an index array or a slice); all FREE before the first hand-out."""
        if self.consumed is not None:
            return self.consumed[rows]
        return np.full(len(range(self.capacity)[rows]) if isinstance(rows, slice) else len(rows), FREE, np.int8)

    def grow(self, capacity: int) -> None:
        self.capacity = capacity
        if self.consumed is not None:
            for attr, _, fill in self.ARRAYS:
                setattr(self, attr, _grow(getattr(self, attr), capacity, fill))


class Partition:
    """A 2D table: rows (samples) x named fields, with production and consumption bookkeeping."""

    def __init__(self, name: str, fields: list[str] | None, consumers: list[str] | None,
                 expected_rows: int | None, auto_clear: bool):
        self.name = name
        self.declared_fields = set(fields) if fields else None
        self.consumers = list(consumers or [])
        self.expected_rows = expected_rows
        self.auto_clear = auto_clear
        self.sealed = False
        self.rolled_back = 0  # appended rows whose put was rolled back: they give back their budget
        self.n = 0
        self.capacity = 0
        self.alive = np.zeros(0, bool)
        self.lost = np.zeros(0, bool)
        self.versions = np.zeros(0, np.int64)
        self.group_ids = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.fields: dict[str, FieldState] = {}
        self.tasks: dict[str, TaskState] = {}
        self.live_rows = 0
        self.lost_rows = 0
        self.cleared_rows = 0
        self._grow_to(1024)

    # ----------------------------------------------------------------- rows and fields
    def _grow_to(self, capacity: int) -> None:
        self.capacity = capacity
        self.alive = _grow(self.alive, capacity, False)
        self.lost = _grow(self.lost, capacity, False)
        self.versions = _grow(self.versions, capacity, -1)
        self.group_ids = _grow(self.group_ids, capacity, -1)
        self.lengths = _grow(self.lengths, capacity, 0)
        for f in self.fields.values():
            f.grow(capacity)
        for t in self.tasks.values():
            t.grow(capacity)

    def add_rows(self, count: int) -> np.ndarray:
        """Append ``count`` rows (alive, no field produced) and return their indexes."""
        if self.sealed:
            raise BadRequestError(f"partition {self.name!r} is sealed; no new rows can be added")
        if self.expected_rows is not None and self.appended + count > self.expected_rows:
            raise BadRequestError(f"partition {self.name!r} expects {self.expected_rows} rows; "
                                  f"{self.appended} exist and {count} more were put")
        if self.n + count > self.capacity:
            self._grow_to(max(self.capacity * 2, self.n + count))
        rows = np.arange(self.n, self.n + count, dtype=np.int64)
        self.n += count
        self.alive[rows] = True
        self.live_rows += count
        if self.expected_rows is not None and self.appended == self.expected_rows:
            self.sealed = True
        return rows

    @property
    def appended(self) -> int:
        """Rows appended by puts that were not rolled back (what ``expected_rows`` counts)."""
        return self.n - self.rolled_back

    def roll_back_rows(self, rows: np.ndarray) -> None:
        """Appended rows of a put that never committed: dropped, and their budget given back (a partition
        that sealed itself when the put was prepared opens again for the rows still owed)."""
        self.drop_rows(rows)
        self.rolled_back += len(rows)
        if self.expected_rows is not None and self.appended < self.expected_rows:
            self.sealed = False

    def check_field_name(self, name) -> None:
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"field names must be non-empty strings, got {name!r}")
        if self.declared_fields is not None and name not in self.declared_fields:
            raise BadRequestError(f"unknown field {name!r}; fields of partition {self.name!r}: "
                                  f"{', '.join(sorted(self.declared_fields))}")

    def field(self, name: str) -> FieldState:
        """The state of a field, created (without a spec) on first mention."""
        state = self.fields.get(name)
        if state is None:
            self.check_field_name(name)
            state = self.fields[name] = FieldState(name, self.capacity)
        return state

    def _produced(self, name: str, rows) -> np.ndarray:
        """Which of ``rows`` have field ``name``; a field never written has no state (a request naming
        it allocates nothing) and no produced rows."""
        f = self.fields.get(name)
        if f is None:
            return np.zeros(len(range(self.capacity)[rows]) if isinstance(rows, slice) else len(rows), bool)
        return f.produced[rows]

    def check_rows(self, rows: np.ndarray) -> None:
        if len(rows) and (rows.min() < 0 or rows.max() >= self.n):
            raise BadRequestError(f"row index out of range for partition {self.name!r} with {self.n} rows")
        if len(rows) and not self.alive[rows].all():
            dead = rows[~self.alive[rows]][:5].tolist()
            raise RowsClearedError(f"rows {dead} of partition {self.name!r} were cleared")
        if len(np.unique(rows)) != len(rows):
            raise BadRequestError("duplicate row indexes in one request")

    # ----------------------------------------------------------------- readiness
    def task(self, name: str) -> TaskState:
        state = self.tasks.get(name)
        if state is None:
            if len(self.tasks) >= MAX_TASKS:
                raise BadRequestError(f"partition {self.name!r} already has {MAX_TASKS} consumer tasks; "
                                      "task names are meant to name RL tasks, not requests")
            state = self.tasks[name] = TaskState(self.capacity)
        return state

    def view(self, task: str, fields: tuple[str, ...]) -> ReadyView:
        """The ready view for (task, fields), built from the arrays the first time it is asked for. At
        most MAX_VIEWS_PER_TASK per task: the least recently used goes (it is rebuilt when asked again)."""
        state = self.task(task)
        view = state.views.pop(fields, None)
        if view is None:
            view = ReadyView(self, fields)
            view.add(np.flatnonzero(self._ready_mask(state, fields)))
            while len(state.views) >= MAX_VIEWS_PER_TASK:
                del state.views[next(iter(state.views))]
        state.views[fields] = view  # most recently used last
        return view

    def _ready_mask(self, state: TaskState, fields: tuple[str, ...]) -> np.ndarray:
        n = self.n
        mask = self.alive[:n] & ~self.lost[:n] & (state.state_of(slice(0, n)) == FREE)
        for name in fields:
            mask &= self._produced(name, slice(0, n))
        return mask

    def on_produced(self, rows: np.ndarray, names: list[str]) -> None:
        """Rows just received ``names``: add them to every view they now satisfy."""
        touched = set(names)
        for state in self.tasks.values():
            for fields, view in state.views.items():
                if touched.isdisjoint(fields):
                    continue
                ok = self.alive[rows] & ~self.lost[rows] & (state.state_of(rows) == FREE)
                for name in fields:
                    ok &= self._produced(name, rows)
                view.add(rows[ok])

    def hand_out(self, task: str, rows: list[int], readers: int, handout: int, lease_end: float) -> None:
        """Mark ``rows`` in flight for ``task`` under hand-out id ``handout``, leased until ``lease_end``;
        they become read once ``readers`` clients acked them."""
        state = self.task(task)
        state.allocate()
        state.consumed[rows] = IN_FLIGHT
        state.readers[rows] = readers
        state.handout[rows] = handout
        state.lease_end[rows] = lease_end
        for view in state.views.values():
            view.remove(rows)

    def renew(self, task: str, rows: np.ndarray, handout: int, lease_end: float) -> np.ndarray:
        """Extend the lease of the rows of ``handout`` still in flight; returns those rows."""
        state = self.tasks.get(task)
        if state is None or not state.allocated:
            return rows[:0]
        rows = rows[(state.consumed[rows] == IN_FLIGHT) & (state.handout[rows] == handout)]
        state.lease_end[rows] = np.maximum(state.lease_end[rows], lease_end)
        return rows

    def expire_leases(self, task: str, rows: np.ndarray, handout: int, now: float) -> int:
        """Rows of ``handout`` still in flight whose lease has ended go back to the task."""
        state = self.tasks.get(task)
        if state is None or not state.allocated:
            return 0
        rows = rows[(rows < self.n)]
        rows = rows[(state.consumed[rows] == IN_FLIGHT) & (state.handout[rows] == handout)
                    & (state.lease_end[rows] <= now) & self.alive[rows]]
        if len(rows):
            self.release(task, rows)
            state.lease_expired += len(rows)
        return len(rows)

    def release(self, task: str, rows: np.ndarray | None) -> int:
        """Give rows handed out but never read back to ``task`` again; returns how many."""
        state = self.task(task)
        if not state.allocated:
            return 0
        consumed = state.consumed[: self.n]
        if rows is None:
            rows = np.flatnonzero(consumed == IN_FLIGHT)
        else:
            rows = rows[consumed[rows] == IN_FLIGHT]
        state.consumed[rows] = FREE
        state.readers[rows] = 0
        state.handout[rows] = -1
        for fields, view in state.views.items():
            ok = self.alive[rows] & ~self.lost[rows]
            for name in fields:
                ok &= self._produced(name, rows)
            view.add(rows[ok], front=True)
        return len(rows)

    def ack(self, task: str, rows: np.ndarray, handout: int | None = None) -> np.ndarray:
        """One reader of ``task`` has read ``rows`` of hand-out ``handout``; returns the rows that all their
        readers have now read. Acks of an older hand-out (the rows were released or their lease ran out,
        and they went out again) are ignored and counted: the new holder has not read them yet."""
        state = self.tasks.get(task)
        if state is None or not state.allocated or not len(rows):
            return rows[:0]
        rows = np.unique(rows[(rows >= 0) & (rows < self.n)])
        rows = rows[state.consumed[rows] == IN_FLIGHT]
        if handout is not None:
            current = state.handout[rows] == handout
            state.stale_acks += int(np.count_nonzero(~current))
            rows = rows[current]
        state.readers[rows] -= 1
        done = rows[state.readers[rows] <= 0]
        state.consumed[done] = READ
        state.readers[done] = 0
        return done

    def in_flight_count(self, task: str) -> int:
        """Rows of ``task`` handed out and not yet read by all their readers."""
        state = self.tasks.get(task)
        if state is None or not state.allocated:
            return 0
        return int(np.count_nonzero(state.consumed[: self.n] == IN_FLIGHT))

    def remaining_unready(self, task: str, fields: tuple[str, ...]) -> int:
        """Unconsumed live rows that may still become ready for (task, fields)."""
        state = self.task(task)
        n = self.n
        candidates = self.alive[:n] & ~self.lost[:n] & (state.state_of(slice(0, n)) == FREE)
        return int(np.count_nonzero(candidates)) - len(self.view(task, fields).ready)

    def missing_summary(self, task: str, fields: tuple[str, ...]) -> dict[str, int]:
        """For the unconsumed live rows of ``task``: how many still lack each field."""
        state = self.task(task)
        n = self.n
        candidates = self.alive[:n] & ~self.lost[:n] & (state.state_of(slice(0, n)) == FREE)
        return {name: int(np.count_nonzero(candidates & ~self._produced(name, slice(0, n)))) for name in fields}

    # ----------------------------------------------------------------- lifecycle
    def unconsumed_by(self, rows: np.ndarray, tasks: list[str]) -> dict[str, int]:
        """Per task, how many of ``rows`` it has not read yet."""
        out = {}
        for task in tasks:
            state = self.tasks.get(task)
            pending = len(rows) if state is None else int(np.count_nonzero(state.state_of(rows) != READ))
            if pending:
                out[task] = pending
        return out

    def in_flight(self, rows: np.ndarray) -> dict[str, int]:
        out = {}
        for task, state in self.tasks.items():
            count = int(np.count_nonzero(state.state_of(rows) == IN_FLIGHT))
            if count:
                out[task] = count
        return out

    def drop_rows(self, rows: np.ndarray) -> None:
        """Mark rows cleared and remove them from every view (their blocks are freed by the caller)."""
        rows = rows[self.alive[rows]]
        self.alive[rows] = False
        self.live_rows -= len(rows)
        self.cleared_rows += len(rows)
        lost = rows[self.lost[rows]]
        self.lost_rows -= len(lost)
        for state in self.tasks.values():
            for view in state.views.values():
                view.remove(rows)

    def close(self) -> None:
        """Drop every per-row structure now. The ready views point back at their partition, so without this
        a cleared partition would wait for Python's cyclic garbage collector to be freed."""
        for state in self.tasks.values():
            state.views.clear()
        self.tasks.clear()
        self.fields.clear()

    def mark_lost(self, rows: np.ndarray) -> None:
        rows = rows[self.alive[rows] & ~self.lost[rows]]
        self.lost[rows] = True
        self.lost_rows += len(rows)
        for state in self.tasks.values():
            for view in state.views.values():
                view.remove(rows)

    def status(self) -> dict:
        """Production and consumption counts, as plain data for msgpack."""
        n = self.n
        alive = self.alive[:n]
        return {
            "rows": int(n), "live_rows": int(self.live_rows), "cleared_rows": int(self.cleared_rows),
            "rolled_back_rows": int(self.rolled_back),
            "lost_rows": int(self.lost_rows), "sealed": self.sealed, "expected_rows": self.expected_rows,
            "consumers": self.consumers, "auto_clear": self.auto_clear,
            "fields": {name: {"spec": f.spec.describe() if f.spec else None,
                              "produced": int(np.count_nonzero(f.produced[:n] & alive))}
                       for name, f in self.fields.items()},
            "tasks": {name: {"in_flight": int(np.count_nonzero((t.state_of(slice(0, n)) == IN_FLIGHT) & alive)),
                             "read": int(np.count_nonzero((t.state_of(slice(0, n)) == READ) & alive)),
                             "lease_expired": t.lease_expired, "stale_acks": t.stale_acks,
                             "ready": {",".join(k): len(v.ready) for k, v in t.views.items()}}
                      for name, t in self.tasks.items()},
        }
