"""Staged versions across hosts: each exporting rank's slot is relayed into one mirror per remote rollout host.

    trainer rank (tp, pp, ep):  stage(v) ──► its slot ──► RelaySender thread ──broadcast, chunk by chunk──┐
                                                                                                         ▼
    rollout host H:  RelayReceiver thread ──► H's mirror segment (same slots and headers) ──► StagingReader
                     (one per remote source, owned by H's first rollout instance; every instance on H reads)

- Which pairs relay is decided in ``asyncflow.bridge.routes``: only exporting ranks and rollout hosts on
  different hosts; a host's instances share its one receiver and mirror.
- One torch.distributed group per exporting rank (group rank 0) and the receivers of its remote hosts (1..R),
  created once per run on a store the driver hosts (``RelayStore``), apart from Megatron's and vLLM's own
  groups. Every collective times out at the run's ``workflow.step_timeout_s``.
- **The trainer never waits.** ``notify(version)`` only wakes the sender thread; if that thread is still busy
  with an older version it later sends only the newest. The receivers run their own threads, so a rollout
  busy generating never delays the broadcast either.
- **Torn versions are dropped, not applied.** The sender reads the slot without locking it: it broadcasts
  the slot's header, the data, then the header again. A receiver that sees two different headers (the
  trainer rewrote the slot meanwhile) leaves that mirror slot marked empty; the next version follows.
- **A fixed, bucket-sized buffer on each side.** The slot travels in chunks of ``weight_sync.bucket_mb``
  through one buffer of that size on the backend's device (a CUDA buffer for NCCL, so a whole-model slot is
  never allocated on a GPU that vLLM already fills; a CPU buffer for gloo, which runs the same chunked code
  in the tests). **The NCCL path is untested on this project (no GPU).**
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import MRank
from asyncflow.bridge.staging import SLOTS, StagingWriter, _Slots, segment_bytes, source_key
from asyncflow.ports import local_address_towards
from asyncflow.transfer_queue.shm import Arena

MIN_CHUNK_MB = 1.0
"""Smallest relay chunk: ``bucket_mb`` may be tiny (tests use one fused group per bucket), and a broadcast of a
few elements costs a round trip each."""


class RelayStore:
    """The rendezvous store of a run's relay groups, hosted by the driver (``host:port`` from the placement)."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 600.0):
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.host, self.port, self.timeout_s = host, self.store.port, timeout_s

    def spec(self, rollout_hosts: list[str], backend: str = "gloo", chunk_mb: float = 512.0,
             transport: str = "auto") -> dict:
        """Plain data for ``RelaySender`` / ``RelayReceiver`` (crosses Ray unchanged): the store, the host key
        of every rollout instance (``asyncflow.bridge.routes``), the backend and the chunk size (``chunk_mb``,
        at least ``MIN_CHUNK_MB``)."""
        return {"host": self.host, "port": self.port, "timeout_s": self.timeout_s, "backend": backend,
                "rollout_hosts": list(rollout_hosts), "chunk_mb": max(chunk_mb, MIN_CHUNK_MB), "transport": transport}


def _group(spec: dict, src: MRank, rank: int, size: int) -> dist.ProcessGroup:
    """Source ``src``'s group of ``size``: the source is rank 0, receiver i is rank i + 1."""
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)
    prefix = dist.PrefixStore(f"relay/{source_key(src)}", store)
    if spec["backend"] == "nccl":  # pragma: no cover - CUDA only, untested on this project
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, nccl)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Listen on the address that reaches the store's node: gloo's default device advertises what the hostname
    # resolves to, often 127.0.0.1, which a peer on another node cannot connect to.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(spec["host"]))]
    return dist.ProcessGroupGloo(prefix, rank, size, opts)


def _device(spec: dict) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if spec["backend"] == "nccl" else torch.device("cpu")


def chunk_numel(spec: dict, numel: int, dtype: torch.dtype) -> int:
    """Elements of the relay buffer: ``chunk_mb`` worth, never more than the slot (at least one)."""
    per = max(1, int(spec.get("chunk_mb", 512.0) * 2**20) // torch.empty((), dtype=dtype).element_size())
    return max(1, min(numel, per))


def _chunks(numel: int, step: int):
    for start in range(0, numel, step):
        yield start, min(step, numel - start)

class _Loop:
    """A daemon thread running ``body`` until ``stop``; its first error is kept and re-raised by ``check``."""

    def __init__(self, name: str, body: Callable[[], None]):
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(body,), name=name, daemon=True)
        self._thread.start()

    def _run(self, body) -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed to the owner through check()
            if not self.stopping.is_set():
                self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight relay failed: {type(self.error).__name__}: {self.error}") from self.error


class RelaySender:
    """Trainer side: broadcasts the newest staged version of ``writer``'s slots to ``receivers`` receivers."""

    def __init__(self, writer: StagingWriter, spec: dict, receivers: int):
        self.writer, self.spec, self.receivers = writer, spec, receivers
        data = writer._slots.data[0]
        self.chunk = chunk_numel(spec, data.numel(), data.dtype)
        self.buffer_bytes = self.chunk * data.element_size()
        self.sent_bytes = 0  # broadcast by this rank (headers and data, each byte once whatever the receivers)
        self.failed: str | None = None  # why the broadcast stopped, once it has
        self._newest, self._cond = -1, threading.Condition()
        self._loop = _Loop(f"relay-send-{source_key(writer.rank)}", self._run)

    def notify(self, version: int) -> None:
        """``version`` was just staged (returns at once). Once the broadcast has failed (a receiving host was lost:
        its processes died, or it went silent for the group's timeout) this rank relays nothing more and the trainer
        goes on: a lost rollout host must not stop training. The failure is printed once and kept in ``failed``;
        rollout hosts that still expected this rank's weights get no newer version (docs/fault_tolerance.md)."""
        if self._loop.error is not None:
            if self.failed is None:
                self.failed = f"{type(self._loop.error).__name__}: {self._loop.error}"
                print(f"weight relay from trainer rank {source_key(self.writer.rank)} stopped ({self.failed[:200]}); "
                      "its receiving hosts get no newer weights", flush=True)
            return
        with self._cond:
            self._newest = max(self._newest, version)
            self._cond.notify()

    def _run(self) -> None:
        group = _group(self.spec, self.writer.rank, 0, self.receivers + 1)
        device, sent = _device(self.spec), -1
        slots = self.writer._slots
        buffer = torch.empty(self.chunk, dtype=slots.data[0].dtype, device=device)  # the only data buffer
        while True:
            with self._cond:
                while not (self._newest > sent or self._loop.stopping.is_set()):
                    self._cond.wait()
                if self._loop.stopping.is_set():  # tell the receivers to stop too
                    group.broadcast(torch.tensor([0, -2], dtype=torch.int64, device=device), 0).wait()
                    return
                version = self._newest
            slot = version % SLOTS
            header = slots.headers[slot].clone()
            data = slots.data[slot]
            group.broadcast(header.to(device), 0).wait()
            for start, n in _chunks(data.numel(), self.chunk):
                buffer[:n].copy_(data[start:start + n])
                group.broadcast(buffer[:n], 0).wait()
                self.sent_bytes += n * buffer.element_size()
            group.broadcast(slots.headers[slot].clone().to(device), 0).wait()  # unchanged, or the copy is torn
            self.sent_bytes += 2 * header.numel() * header.element_size()
            sent = version

    def close(self) -> None:
        """Stop the thread (the receivers stop with it)."""
        self._loop.stopping.set()
        with self._cond:
            self._cond.notify()
        self._loop._thread.join(timeout=5.0)  # receivers that are gone already cannot answer: do not wait


class RelayReceiver:
    """Rollout side, one per remote source on each rollout host: mirrors the source's slots into a local
    segment, calling ``on_version(version, source_key, segment)`` once a complete, untorn version is mirrored.
    ``receiver`` is this host's index among the source's ``receivers`` (``routes.remote_hosts``)."""

    def __init__(self, plan: SyncPlan, src: MRank, spec: dict, receiver: int, receivers: int, segment: str,
                 on_version: Callable[[int, str, str], None]):
        self.plan, self.src, self.spec, self.receiver, self.receivers = plan, src, spec, receiver, receivers
        self.segment, self.on_version = segment, on_version
        self._slots = _Slots(Arena.create(segment_bytes(plan, src), segment), plan, src)
        for header in self._slots.headers:
            header[1] = -1
        data = self._slots.data[0]
        self.chunk = chunk_numel(spec, data.numel(), plan.dtype)
        self.buffer_bytes = self.chunk * data.element_size()
        # Bytes that came over the network into this mirror (headers and data, torn versions included) and the
        # complete versions mirrored: written by the thread only, read by the owner (``layout.json``).
        self.received_bytes, self.versions = 0, 0
        self._loop = _Loop(f"relay-recv-{source_key(src)}", self._run)

    def _run(self) -> None:
        group = _group(self.spec, self.src, self.receiver + 1, self.receivers + 1)
        device = _device(self.spec)
        head, tail = torch.zeros(2, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
        buffer = torch.empty(self.chunk, dtype=self.plan.dtype, device=device)  # the only data buffer
        while True:
            group.broadcast(head, 0).wait()
            self.received_bytes += head.numel() * head.element_size()
            seq, version = (int(x) for x in head.cpu())
            if version == -2:
                return
            slot = version % SLOTS
            mirror, target = self._slots.headers[slot], self._slots.data[slot]
            mirror[0] += 1  # odd: readers of this mirror slot start over
            mirror[1] = -1
            for start, n in _chunks(target.numel(), self.chunk):
                group.broadcast(buffer[:n], 0).wait()
                target[start:start + n].copy_(buffer[:n])
                self.received_bytes += n * buffer.element_size()
            group.broadcast(tail, 0).wait()
            self.received_bytes += tail.numel() * tail.element_size()
            complete = torch.equal(head.cpu(), tail.cpu()) and seq % 2 == 0 and version >= 0
            mirror[1] = version if complete else -1
            mirror[0] += 1
            if complete:
                self.versions += 1
                self.on_version(version, source_key(self.src), self.segment)

    def check(self) -> None:
        """Raise if the thread failed."""
        self._loop.check()

    def close(self) -> None:
        """Stop waiting for the sender (at the end of the run) and remove the mirror."""
        self._loop.stopping.set()
        self._loop._thread.join(timeout=1.0)
        self._slots.close()
