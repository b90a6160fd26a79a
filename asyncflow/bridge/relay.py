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
- **Groups re-form when a receiving host drops out.** A group lives for one *generation*: the sender and the
  receivers it names (``g<n>/members`` on the store). When a broadcast fails (a receiver's process died, or its
  host went silent for the group's timeout) the sender drops the group, which fails the other receivers' waits
  too, and each asks into the next generation (``g<n+1>/want/<receiver>``). The sender forms it from those that
  asked within ``REFORM_WINDOW_S`` and sends its newest version again. A receiver that starts later (its rollout
  instance restarted on that host) asks into the generation after the current one; the sender moves everyone
  there before its next send, or within a second while idle. So a lost host costs the others one version, not
  every later one. A generation after the first must form within ``FORM_TIMEOUT_S``: a member that asked into it
  and died before it formed (a second host lost meanwhile) fails that formation, not the group's timeout, and
  the next generation forms without it.
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
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import MRank
from asyncflow.bridge.staging import SLOTS, StagingWriter, _Slots, segment_bytes, source_key
from asyncflow.ports import local_address_towards
from asyncflow.transfer_queue.shm import Arena

FORM_TIMEOUT_S = 30.0
"""How long a generation after the first may take to form (its members connecting); the group's collectives keep the
run's timeout. Its members asked into it just before, so each was up: one that died since cannot connect, and the
formation fails after this instead of after ``workflow.step_timeout_s``. Generation 0 forms while the rollout
engines may still be loading, with the run's timeout. A spec may set its own (``form_timeout_s``)."""
REFORM_WINDOW_S = 5.0
"""How long the sender waits, once a generation broke, for the receivers still alive to ask into the next one (each
notices within a moment: its group fails with the sender's). One that asks later joins the generation after."""
POLL_S = 0.2

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


def _store(spec: dict, src: MRank) -> dist.Store:
    """Source ``src``'s part of the run's relay store (its generations' members, wants and groups)."""
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)
    return dist.PrefixStore(f"relay/{source_key(src)}", store)


def _group(spec: dict, src: MRank, rank: int, size: int, generation: int = 0,
           store: dist.Store | None = None) -> dist.ProcessGroup:
    """Source ``src``'s group of ``size`` in ``generation``: the source is rank 0, the members are ranks 1..
    Forming it fails after ``FORM_TIMEOUT_S`` from generation 1 on; its collectives time out at the run's timeout."""
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    prefix = dist.PrefixStore(f"g{generation}", _store(spec, src) if store is None else store)
    if spec["backend"] == "nccl":  # pragma: no cover - CUDA only, untested on this project
        # NCCL connects lazily, at the first collective: a dead member fails it at the run's timeout.
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, nccl)
    opts = dist.ProcessGroupGloo._Options()
    form = min(spec.get("form_timeout_s", FORM_TIMEOUT_S), spec["timeout_s"]) if generation else spec["timeout_s"]
    opts._timeout = datetime.timedelta(seconds=form)  # gloo connects every pair here, within this
    # Listen on the address that reaches the store's node: gloo's default device advertises what the hostname
    # resolves to, often 127.0.0.1, which a peer on another node cannot connect to.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(spec["host"]))]
    group = dist.ProcessGroupGloo(prefix, rank, size, opts)
    group.set_timeout(timeout)
    return group


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
    """A daemon thread running ``body`` until ``stop``; its first error is kept and re-raised by ``check``.
    Started by ``start`` once the owner holds it: ``body`` reads ``owner._loop``, and a thread started in the
    constructor can get there before the assignment does (seen on a loaded machine)."""

    def __init__(self, name: str, body: Callable[[], None]):
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(body,), name=name, daemon=True)

    def start(self) -> _Loop:
        self._thread.start()
        return self

    def _run(self, body) -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed to the owner through check()
            if not self.stopping.is_set():
                self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight relay failed: {type(self.error).__name__}: {self.error}") from self.error


STOP, REFORM = -2, -3
"""Header versions that are not versions: the sender stops (end of the run), or moves its receivers to the next
generation (one asked to join)."""


def _members(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r]


class RelaySender:
    """Trainer side: broadcasts the newest staged version of ``writer``'s slots to the receivers of its ``receivers``
    remote rollout hosts that are up (the current generation's members, module docstring)."""

    def __init__(self, writer: StagingWriter, spec: dict, receivers: int):
        self.writer, self.spec, self.receivers = writer, spec, receivers
        data = writer._slots.data[0]
        self.chunk = chunk_numel(spec, data.numel(), data.dtype)
        self.buffer_bytes = self.chunk * data.element_size()
        self.sent_bytes = 0  # broadcast by this rank (headers and data, each byte once whatever the receivers)
        self.failed: str | None = None  # why the relay stopped, once an error of its own thread stopped it
        self.generation, self.members = 0, list(range(receivers))  # generation 0: every remote host's receiver
        self.ended: list[str] = []  # why each generation before the current one ended
        self._newest, self._cond = -1, threading.Condition()
        self._loop = _Loop(f"relay-send-{source_key(writer.rank)}", self._run)
        self._loop.start()

    def notify(self, version: int) -> None:
        """``version`` was just staged (returns at once). A receiving host that drops out never stops training: the
        group re-forms without it. Only an error of the sender's own thread ends the relay; it is printed once and
        kept in ``failed``, and rollout hosts that read this rank through the relay get no newer version."""
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
        store = _store(self.spec, self.writer.rank)
        device, slots = _device(self.spec), self.writer._slots
        buffer = torch.empty(self.chunk, dtype=slots.data[0].dtype, device=device)  # the only data buffer
        store.set("g0/members", ",".join(map(str, self.members)))
        store.set("generation", "0")
        try:
            group, sent = _group(self.spec, self.writer.rank, 0, self.receivers + 1, 0, store), -1
        except Exception as exc:  # noqa: BLE001 - a receiver died before the first group formed
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = None
        if why is not None:
            group, sent = self._next(store, why), -1
        while True:
            with self._cond:  # a second at most: a receiver that starts later asks to join while nothing is sent
                self._cond.wait_for(lambda g=group, s=sent: (g is not None and self._newest > s)
                                    or self._loop.stopping.is_set(), timeout=1.0)
                version = self._newest
            stopping = self._loop.stopping.is_set()
            joining = not stopping and self._asked(store, self.generation + 1)
            if group is not None and (stopping or joining):
                try:
                    self._header(group, [0, STOP if stopping else REFORM], device)
                except Exception:  # noqa: BLE001 - a receiver already gone: the others fail with the group below
                    pass
            if stopping:
                return
            why = "a receiver asked to join" if joining else None
            if group is not None and why is None and version > sent:
                try:
                    self._send(group, buffer, slots, version, device)
                    sent = version
                    continue
                except Exception as exc:  # noqa: BLE001 - a receiving host dropped out: re-form without it
                    why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                # Dropped here, outside the handler (the exception's frames hold it): the receivers still waiting
                # in it fail at once and ask into the next generation.
                group = None
                group, sent = self._next(store, why), -1

    def _header(self, group, header: list[int], device) -> None:
        group.broadcast(torch.tensor(header, dtype=torch.int64, device=device), 0).wait()

    def _send(self, group, buffer: torch.Tensor, slots, version: int, device) -> None:
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

    def _asked(self, store, generation: int) -> list[int]:
        """The receivers that asked into ``generation``."""
        return [r for r in range(self.receivers) if store.check([f"g{generation}/want/{r}"])]

    def _next(self, store, why: str):
        """The next generation's group: the receivers that ask into it within ``REFORM_WINDOW_S`` of its start (all
        of them, or every one that asked by then), else the first that asks after. None once the relay stops."""
        while not self._loop.stopping.is_set():
            self.ended.append(why)
            self.generation += 1
            n, began = self.generation, time.monotonic()
            print(f"weight relay from trainer rank {source_key(self.writer.rank)}: generation {n - 1} ended "
                  f"({why[:200]}); re-forming with the receiving hosts still up", flush=True)
            while not self._loop.stopping.is_set():
                asked = self._asked(store, n)
                if len(asked) == self.receivers or (asked and time.monotonic() - began >= REFORM_WINDOW_S):
                    break
                time.sleep(POLL_S)
            else:
                return None
            self.members = asked
            store.set(f"g{n}/members", ",".join(map(str, asked)))
            store.set("generation", str(n))
            try:
                return _group(self.spec, self.writer.rank, 0, len(asked) + 1, n, store)
            except Exception as exc:  # noqa: BLE001 - a member died before the group formed
                why = f"{type(exc).__name__}: {exc}"
        return None

    def close(self) -> None:
        """Stop the thread (the receivers stop with it)."""
        self._loop.stopping.set()
        with self._cond:
            self._cond.notify()
        self._loop._thread.join(timeout=5.0)  # receivers that are gone already cannot answer: do not wait


class RelayReceiver:
    """Rollout side, one per remote source on each rollout host: mirrors the source's slots into a local
    segment, calling ``on_version(version, source_key, segment)`` once a complete, untorn version is mirrored.
    ``receiver`` is this host's index among the source's ``receivers`` (``routes.remote_hosts``): a receiver
    started again on that host (its rollout instance restarted) takes the same index and asks into the sender's
    next generation."""

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
        # Bytes that came over the network into this mirror (headers and data, torn versions included), the
        # complete versions mirrored and the generations joined: written by the thread only, read by the owner
        # (``layout.json``).
        self.received_bytes, self.versions, self.generations = 0, 0, []
        self._loop = _Loop(f"relay-recv-{source_key(src)}", self._run)
        self._loop.start()

    def _run(self) -> None:
        store = _store(self.spec, self.src)
        if not self._wait(store, "generation"):
            return
        n = int(store.get("generation"))
        while not self._loop.stopping.is_set():
            if not self._wait(store, f"g{n}/members"):
                return
            members = _members(store.get(f"g{n}/members").decode())
            # Once per generation and receiver: a receiver started again on this host asks into the next one.
            if self.receiver in members and store.add(f"g{n}/joined/{self.receiver}", 1) == 1:
                try:
                    group = _group(self.spec, self.src, members.index(self.receiver) + 1, len(members) + 1, n,
                                   store)
                    self.generations.append(n)
                    if self._mirror(group) == STOP:
                        return
                except Exception:  # noqa: BLE001 - the generation broke (the sender or another host dropped out)
                    if self._loop.stopping.is_set():
                        return
                group = None
            n += 1
            store.set(f"g{n}/want/{self.receiver}", "1")

    def _wait(self, store, key: str) -> bool:
        """Wait for ``key`` on the store until the receiver stops (False then)."""
        while not store.check([key]):
            if self._loop.stopping.wait(POLL_S):
                return False
        return True

    def _mirror(self, group) -> int:
        """Mirror the versions ``group`` sends until the sender stops (``STOP``) or moves on (``REFORM``)."""
        device = _device(self.spec)
        head, tail = torch.zeros(2, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
        buffer = torch.empty(self.chunk, dtype=self.plan.dtype, device=device)  # the only data buffer
        while True:
            group.broadcast(head, 0).wait()
            self.received_bytes += head.numel() * head.element_size()
            seq, version = (int(x) for x in head.cpu())
            if version in (STOP, REFORM):
                return version
            slot = version % SLOTS
            mirror, target = self._slots.headers[slot], self._slots.data[slot]
            mirror[0] += 1  # odd: readers of this mirror slot start over
            mirror[1] = -1
            complete = False
            try:
                for start, n in _chunks(target.numel(), self.chunk):
                    group.broadcast(buffer[:n], 0).wait()
                    target[start:start + n].copy_(buffer[:n])
                    self.received_bytes += n * buffer.element_size()
                group.broadcast(tail, 0).wait()
                self.received_bytes += tail.numel() * tail.element_size()
                complete = torch.equal(head.cpu(), tail.cpu()) and seq % 2 == 0 and version >= 0
            finally:  # even: readers may read it again (empty when the group broke mid-version)
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
