"""Samplers: which ready rows a consumer receives. A small name -> class registry.

A sampler sees the rows that are ready for a task (every requested field produced, not yet handed to
that task), in the order they became ready, and picks up to ``n`` of them. Samplers run inside the
controller for every request, so the common ones take O(n) time, not O(rows in the partition); ``shortest``
looks at every ready row (O(ready x log n)).

DP awareness is not a sampler of its own: every sampler is DP-rank-aware through the request's
``dp_rank``/``mp_rank``/``mp_size`` (all model-parallel ranks of one DP replica receive the same rows),
and samplers with ``joint_dp = True`` pick one batch for all ``dp_size`` replicas and split it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from .errors import BadRequestError

if TYPE_CHECKING:
    from .partition import ReadyView

SAMPLERS: dict[str, type[Sampler]] = {}


def register_sampler(name: str) -> Callable[[type[Sampler]], type[Sampler]]:
    """Class decorator: make a sampler available under ``name``."""

    def wrap(cls: type[Sampler]) -> type[Sampler]:
        if name in SAMPLERS and SAMPLERS[name] is not cls:
            raise ValueError(f"sampler {name!r} is already registered by {SAMPLERS[name].__name__}")
        SAMPLERS[name] = cls
        cls.name = name
        return cls

    return wrap


def make_sampler(name: str, kwargs: dict | None) -> Sampler:
    """Instantiate a registered sampler; unknown names and arguments raise BadRequestError."""
    cls = SAMPLERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise BadRequestError(f"unknown sampler {name!r}; valid samplers: {', '.join(sorted(SAMPLERS))}")
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict):
        raise BadRequestError("sampler arguments must be a mapping")
    unknown = set(kwargs) - set(cls.params)
    if unknown:
        raise BadRequestError(f"sampler {name!r} takes {sorted(cls.params) or 'no arguments'}, "
                              f"not {sorted(unknown)}")
    return cls(**kwargs)


class Sampler:
    """Base class. Subclasses set ``params`` (accepted keyword arguments) and implement ``select``."""

    name = "base"
    params: tuple[str, ...] = ()
    joint_dp = False
    """True: the controller asks for ``n * dp_size`` rows once and splits them with ``split``."""

    def select(self, view: ReadyView, n: int) -> list[int]:
        """Pick at most ``n`` rows from ``view.ready`` (an ordered mapping of row -> None)."""
        raise NotImplementedError

    def split(self, rows: list[int], lengths: np.ndarray, parts: int) -> list[list[int]]:
        """Divide a joint batch among DP replicas; default: contiguous, near-equal row counts."""
        bounds = np.linspace(0, len(rows), parts + 1).round().astype(int)
        return [rows[bounds[i]:bounds[i + 1]] for i in range(parts)]

    def check(self, n: int) -> None:
        """Validate the batch size for this sampler (raise BadRequestError)."""


def _int_arg(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequestError(f"sampler argument {name} must be an integer >= {minimum}, got {value!r}")
    return value


@register_sampler("sequential")
class SequentialSampler(Sampler):
    """First come, first served: rows in the order they became ready."""

    def select(self, view: ReadyView, n: int) -> list[int]:
        return list(islice(view.ready, n))


@register_sampler("group")
class GroupSampler(Sampler):
    """GRPO groups go out whole or not at all: only groups whose ``group_size`` rows are all ready.

    Rows without a group id (-1) are never handed out by this sampler.
    """

    params = ("group_size",)

    def __init__(self, group_size: int = 0):
        self.group_size = _int_arg("group_size", group_size, 1)

    def check(self, n: int) -> None:
        if n < self.group_size:
            raise BadRequestError(f"batch_size {n} is smaller than group_size {self.group_size}; "
                                  "a group cannot be split")

    def select(self, view: ReadyView, n: int) -> list[int]:
        out: list[int] = []
        for members in view.by_group.values():
            if len(out) + self.group_size > n:
                break
            if len(members) >= self.group_size:
                out.extend(islice(members, self.group_size))
        return out


@register_sampler("version")
class VersionSampler(Sampler):
    """Oldest weight version first; rows older than ``current_version - max_staleness`` never go out.

    Rows put without a version (-1) are not eligible: their staleness cannot be checked.
    """

    params = ("current_version", "max_staleness")

    def __init__(self, current_version: int = 0, max_staleness: int | None = None):
        self.current_version = _int_arg("current_version", current_version, 0)
        self.max_staleness = None if max_staleness is None else _int_arg("max_staleness", max_staleness, 0)

    def select(self, view: ReadyView, n: int) -> list[int]:
        if not view.ready:
            return []
        rows = np.fromiter(view.ready, np.int64, count=len(view.ready))
        versions = view.versions[rows]
        low = 0 if self.max_staleness is None else self.current_version - self.max_staleness
        keep = (versions >= max(low, 0)) & (versions <= self.current_version)
        rows, versions = rows[keep], versions[keep]
        order = np.argsort(versions, kind="stable")[:n]
        return rows[order].tolist()


@register_sampler("token_balanced")
class TokenBalancedSampler(Sampler):
    """Takes rows first come, first served for all DP replicas at once, then splits them so that
    every replica gets the same number of rows and as equal a token count as greedy allows
    (longest row first to the replica with the fewest tokens)."""

    joint_dp = True

    def select(self, view: ReadyView, n: int) -> list[int]:
        return list(islice(view.ready, n))

    def split(self, rows: list[int], lengths: np.ndarray, parts: int) -> list[list[int]]:
        # Give every replica floor/ceil of the rows, then balance tokens within that constraint.
        caps = [len(rows) // parts + (1 if i < len(rows) % parts else 0) for i in range(parts)]
        heap = [(0, i) for i in range(parts)]
        bins: list[list[int]] = [[] for _ in range(parts)]
        order = sorted(range(len(rows)), key=lambda k: -int(lengths[k]))
        for k in order:
            full = []
            while True:
                load, i = heapq.heappop(heap)
                if len(bins[i]) < caps[i]:
                    break
                full.append((load, i))
            bins[i].append(rows[k])
            heapq.heappush(heap, (load + int(lengths[k]), i))
            for item in full:
                heapq.heappush(heap, item)
        return [sorted(b) for b in bins]


@register_sampler("shortest")
class ShortestSampler(Sampler):
    """The ``n`` shortest ready rows (row ``lengths``; ties in ready order): rows of like length share a batch.

    A trainer pads a micro-batch to its longest row, so when many rows are ready at once (a sync step, or a
    consumer a step behind its producer) taking them in ready order pads every batch to some long row;
    shortest first pads each to about its own length. When rows arrive one batch at a time it is first come,
    first served. With ``dp_size`` replicas it picks ``n x dp_size`` rows at once and deals them out in
    turn, shortest first, so every replica gets rows of about the same lengths (and, except at a step's end,
    the same count).
    """

    joint_dp = True

    def select(self, view: ReadyView, n: int) -> list[int]:
        lengths = view.lengths
        return heapq.nsmallest(n, view.ready, key=lambda row: int(lengths[row]))  # stable: ready order on ties

    def split(self, rows: list[int], lengths: np.ndarray, parts: int) -> list[list[int]]:
        order = sorted(range(len(rows)), key=lambda k: int(lengths[k]))
        return [[rows[k] for k in order[i::parts]] for i in range(parts)]
