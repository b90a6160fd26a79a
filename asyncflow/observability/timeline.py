"""Timeline of what every worker group did: spans recorded anywhere, merged, written as a trace and a chart.

A span is (group, name, worker, start, end, args) with unix-time seconds, so spans recorded in other
processes (Ray actors) line up once merged: an actor keeps its own ``Timeline``, ships
``export_spans(clear=True)`` (plain dicts, msgpack/JSON-able) and the driver calls ``merge``.

Outputs: ``timeline.json`` in Chrome trace-event format (open in https://ui.perfetto.dev or
chrome://tracing; one process per worker group, one thread per worker) and ``timeline.png``, a Gantt
chart with one row per worker, so that pipeline overlap and idle gaps are visible at a glance.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SPAN_FIELDS = ("group", "name", "worker", "start", "end", "args")


def _union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of ``intervals`` clipped to [lo, hi]."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _worker_key(worker: str | int) -> tuple[int, Any]:
    # Integer ranks sort numerically and before named workers; "rank 10" must not come before "rank 2".
    return (0, worker) if isinstance(worker, int) else (1, str(worker))


class Timeline:
    """Thread-safe recorder of spans per worker group and worker.

    Args:
        enabled: when False, ``span`` and ``add`` record nothing (the cost of a disabled timeline is nil).
        clock: returns unix-time seconds; every process of a run must use the same kind of clock.
    """

    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.time):
        self.enabled = enabled
        self.clock = clock
        self._spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, group: str, name: str, worker: str | int = 0, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the ``with`` block as a span. Yields the args dict, so the block can add results to it.

        A block that raises is still recorded, with ``error`` set to the exception type.
        """
        start = self.clock()
        try:
            yield args
        except BaseException as exc:
            args["error"] = type(exc).__name__
            raise
        finally:
            self.add(group, name, start, self.clock(), worker, args)

    def add(self, group: str, name: str, start: float, end: float, worker: str | int = 0,
            args: Mapping[str, Any] | None = None) -> None:
        """Record a span measured elsewhere (unix-time seconds)."""
        if not self.enabled:
            return
        span = {"group": str(group), "name": str(name), "worker": worker, "start": float(start),
                "end": max(float(start), float(end)), "args": dict(args or {})}
        with self._lock:
            self._spans.append(span)

    def export_spans(self, clear: bool = False) -> list[dict[str, Any]]:
        """The recorded spans as plain dicts (to send to another process); ``clear`` drops them here."""
        with self._lock:
            spans = [dict(s, args=dict(s["args"])) for s in self._spans]
            if clear:
                self._spans.clear()
        return spans

    def merge(self, spans: Iterable[Mapping[str, Any]]) -> None:
        """Add spans exported by another ``Timeline`` (any process of the same run)."""
        for span in spans:
            missing = [f for f in SPAN_FIELDS[:5] if f not in span]
            if missing:
                raise ValueError(f"span {dict(span)!r} lacks {missing}; spans need {list(SPAN_FIELDS)}")
            self.add(span["group"], span["name"], span["start"], span["end"], span["worker"], span.get("args"))

    def __len__(self) -> int:
        return len(self._spans)

    def _snapshot(self) -> list[dict[str, Any]]:
        # Span dicts are never mutated after ``add``, so a shallow copy of the list is a consistent view.
        with self._lock:
            return list(self._spans)

    # ---- analysis ---------------------------------------------------------------------------------

    def groups(self) -> list[str]:
        """Worker groups in the order their first span started (pipeline order, usually)."""
        first: dict[str, float] = {}
        for s in self._snapshot():
            first[s["group"]] = min(first.get(s["group"], s["start"]), s["start"])
        return sorted(first, key=first.__getitem__)

    def rows(self) -> list[tuple[str, str | int]]:
        """(group, worker) pairs: groups in ``groups()`` order, workers sorted within a group."""
        spans = self._snapshot()
        return [(g, w) for g in self.groups()
                for w in sorted({s["worker"] for s in spans if s["group"] == g}, key=_worker_key)]

    def wall_span(self) -> tuple[float, float]:
        """(first start, last end) over all spans, unix seconds."""
        spans = self._snapshot()
        if not spans:
            raise ValueError("the timeline has no spans")
        return min(s["start"] for s in spans), max(s["end"] for s in spans)

    def idle_fraction(self, group: str, worker: str | int | None = None,
                      window: tuple[float, float] | None = None) -> float:
        """1 - (union of the group's busy spans) / (run wall span); a worker's alone when ``worker`` is given.

        ``window`` (unix seconds) replaces the run's wall span, e.g. to leave start-up out.
        """
        spans = self._snapshot()
        if group not in {s["group"] for s in spans}:
            raise ValueError(f"no spans for group {group!r}; groups: {self.groups()}")
        lo, hi = window or self.wall_span()
        if hi <= lo:
            return 0.0
        busy = _union_length(((s["start"], s["end"]) for s in spans
                              if s["group"] == group and (worker is None or s["worker"] == worker)), lo, hi)
        return 1.0 - busy / (hi - lo)

    def idle_fractions(self) -> dict[str, float]:
        """``idle_fraction`` of every group, in ``groups()`` order."""
        return {g: self.idle_fraction(g) for g in self.groups()}

    # ---- outputs ----------------------------------------------------------------------------------

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON: complete ("X") events with microseconds from the first span.

        ``pid`` numbers the worker groups and ``tid`` the workers of a group; ``process_name``,
        ``thread_name`` and sort-index metadata events give them their names and the order of ``rows()``.
        """
        spans = self._snapshot()
        if not spans:
            return {"traceEvents": [], "displayTimeUnit": "ms"}
        t0 = min(s["start"] for s in spans)
        pids = {g: i + 1 for i, g in enumerate(self.groups())}
        tids: dict[tuple[str, str | int], int] = {}
        events: list[dict[str, Any]] = []
        for group, worker in self.rows():
            pid = pids[group]
            tid = tids[(group, worker)] = sum(g == group for g, _ in tids)
            if tid == 0:
                events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": group}})
                events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                               "args": {"sort_index": pid}})
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"{group}/{worker}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in sorted(spans, key=lambda s: s["start"]):
            events.append({"ph": "X", "name": s["name"], "cat": s["group"], "pid": pids[s["group"]],
                           "tid": tids[(s["group"], s["worker"])], "ts": (s["start"] - t0) * 1e6,
                           "dur": (s["end"] - s["start"]) * 1e6, "args": s["args"]})
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"start_unix_time": t0}}

    def write_chrome_trace(self, path: str | Path) -> Path:
        """Write ``to_chrome_trace()`` to ``path``; span args that JSON cannot hold are written as strings."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome_trace(), default=str), encoding="utf-8")
        return path

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Write the Gantt chart PNG (see ``plots.plot_gantt``)."""
        from .plots import plot_gantt  # matplotlib only when a chart is asked for

        return plot_gantt(self, path, title=title)

    def write(self, out_dir: str | Path, plot: bool = True) -> list[Path]:
        """Write ``timeline.json`` and, with ``plot`` and at least one span, ``timeline.png`` into ``out_dir``."""
        out_dir = Path(out_dir)
        written = [self.write_chrome_trace(out_dir / "timeline.json")]
        if plot and len(self):
            written.append(self.plot(out_dir / "timeline.png"))
        return written
