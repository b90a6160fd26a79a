"""Links that carry bucket buffers from each exporting Megatron rank to every vLLM receiver rank.

One link per exporting rank ("source"), each a standalone torch.distributed process group of that source
(group rank 0) and all receivers (1..R), created on its own store so it never touches Megatron's or
vLLM's default process group:

- ``shm`` (one host): the source packs its bucket straight into a shared-memory segment; the group only
  carries a one-element "ready" broadcast and a one-element "free" all-reduce per bucket. Receivers read
  the segment with ``torch.frombuffer`` (no bytes through pickle or sockets). The store is a file in
  /dev/shm, so nothing listens on a port.
- ``broadcast`` (across hosts): the bucket buffer itself is broadcast from the source; gloo here, NCCL on
  GPUs (same code, ``backend="nccl"``; untested on this CPU-only project). The store is a TCPStore hosted
  by the first source.

Both sides call their link methods in the same (plan) order, which is what keeps the groups in step.
"""

from __future__ import annotations

import dataclasses
import datetime
import mmap
import threading
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from asyncflow.bridge.shards import MRank


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """Everything a process needs to join the sync groups; plain data (msgpack-able via ``asdict``)."""

    transport: str  # "shm" | "broadcast"
    session: str  # unique per trainer/rollout pairing; names the store keys and shm segments
    num_receivers: int
    backend: str = "gloo"
    store_path: str = ""  # shm: FileStore file
    host: str = "127.0.0.1"  # broadcast: TCPStore address
    port: int = 0
    timeout_s: float = 600.0

    @classmethod
    def from_dict(cls, data: dict) -> LinkSpec:
        """Inverse of ``dataclasses.asdict``."""
        return cls(**data)


def _store(spec: LinkSpec, is_master: bool) -> dist.Store:
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.transport == "shm":
        return dist.FileStore(spec.store_path, -1)
    return dist.TCPStore(spec.host, spec.port, is_master=is_master, timeout=timeout, wait_for_workers=False)


def _group(spec: LinkSpec, store: dist.Store, src: MRank, rank: int) -> dist.ProcessGroup:
    """The standalone group of source ``src`` (rank 0) and the receivers (1..R)."""
    prefix = dist.PrefixStore(f"{spec.session}/src{src.tp}.{src.pp}.{src.ep}", store)
    size, timeout = spec.num_receivers + 1, datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "nccl":  # pragma: no cover - CUDA only, untested on this project
        return dist.ProcessGroupNCCL(prefix, rank, size)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    if spec.transport == "shm" or spec.host in ("127.0.0.1", "localhost"):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # stay on loopback
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(prefix, rank, size, opts)


def _shm_name(spec: LinkSpec, src: MRank) -> str:
    return f"af-{spec.session}-{src.tp}-{src.pp}-{src.ep}"


class SourceLink:
    """Exporter side: ``buf = acquire(n)``, pack ``n`` elements into ``buf``, then ``commit(n)``."""

    def __init__(self, spec: LinkSpec, src: MRank, max_numel: int, dtype: torch.dtype):
        self.spec, self.src = spec, src
        self.store = _store(spec, is_master=src == MRank(0, 0, 0))
        item = torch.empty((), dtype=dtype).element_size()
        self.shm = None
        if spec.transport == "shm":
            # Created before the group rendezvous, so receivers can attach once the group exists.
            self.shm = shared_memory.SharedMemory(
                _shm_name(spec, src), create=True, size=max(max_numel * item, 1)
            )
            self.buffer = (
                torch.frombuffer(self.shm.buf, dtype=dtype, count=max_numel)
                if max_numel
                else torch.empty(0, dtype=dtype)
            )
        else:
            self.buffer = torch.empty(max_numel, dtype=dtype)
        self.group = _group(spec, self.store, src, 0)
        self._token = torch.zeros(1, dtype=torch.int64)

    def acquire(self, numel: int) -> torch.Tensor:
        """The buffer to pack the next bucket into (waits until every receiver is done with the last)."""
        if self.shm is not None:
            self.group.allreduce([self._token]).wait()
        return self.buffer[:numel]

    def commit(self, numel: int) -> None:
        """Hand the packed bucket to the receivers."""
        if self.shm is not None:
            self._token.fill_(numel)
            self.group.broadcast(self._token, 0).wait()
        else:
            self.group.broadcast(self.buffer[:numel], 0).wait()

    def close(self) -> None:
        """Wait for the receivers to finish the last bucket, then free the segment and the group."""
        if self.shm is not None:
            self.group.allreduce([self._token]).wait()
            del self.buffer
            self.shm.close()
            self.shm.unlink()
        self.group = None


class SinkLinks:
    """Receiver side: one link per source; ``recv(src, n)`` returns a view valid until the next ``recv``."""

    def __init__(self, spec: LinkSpec, receiver: int, sources: dict[MRank, int], dtype: torch.dtype):
        self.spec, self.dtype = spec, dtype
        self.store = _store(spec, is_master=False)
        self.groups, self.buffers, self.shms = {}, {}, {}
        for src, max_numel in sources.items():
            self.groups[src] = _group(spec, self.store, src, receiver + 1)
            if spec.transport == "shm":
                self.shms[src] = _attach(_shm_name(spec, src))
                self.buffers[src] = (
                    torch.frombuffer(self.shms[src].buf, dtype=dtype, count=max_numel)
                    if max_numel
                    else torch.empty(0, dtype=dtype)
                )
            else:
                self.buffers[src] = torch.empty(max_numel, dtype=dtype)
        self._token = torch.zeros(1, dtype=torch.int64)

    def recv(self, src: MRank, numel: int) -> torch.Tensor:
        """The next bucket buffer from ``src`` (``numel`` elements, checked against what it sent)."""
        group = self.groups[src]
        if self.spec.transport == "shm":
            group.allreduce([self._token.zero_()]).wait()
            group.broadcast(self._token, 0).wait()
            if int(self._token) != numel:
                raise RuntimeError(f"source {tuple(src)} sent {int(self._token)} elements, plan says {numel}")
        else:
            group.broadcast(self.buffers[src][:numel], 0).wait()
        return self.buffers[src][:numel]

    def release(self, src: MRank) -> None:
        """Drop ``src``'s shared-memory pages from this process's resident set once they are consumed.

        The pages belong to the source's segment (the data stays there); without this the receiver's
        resident memory grows by every page it ever read, up to the largest fused group per source.
        """
        shm = self.shms.get(src)
        if shm is not None and hasattr(mmap, "MADV_DONTNEED"):
            shm._mmap.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Release every segment (after the last bucket) and let the sources free theirs."""
        for group in self.groups.values():
            if self.spec.transport == "shm":
                group.allreduce([self._token]).wait()
        self.buffers.clear()
        for shm in self.shms.values():
            shm.close()
        self.groups.clear()


_ATTACH_LOCK = threading.Lock()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to a source's segment without registering it with this process's resource tracker.

    On Python < 3.13 attaching registers the segment, and the tracker would unlink it (the source owns
    it) or, when several vLLM workers share one tracker, complain about double unregistering.
    """
    from multiprocessing import resource_tracker

    with _ATTACH_LOCK:
        original = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name)
        finally:
            resource_tracker.register = original
