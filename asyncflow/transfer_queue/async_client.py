"""asyncio TransferQueue client: the operations of ``TransferQueueClient`` as coroutines.

Many coroutines may share one client: every connection multiplexes requests by id, with one reader
task that resolves the matching futures, so a task blocked in ``get`` does not stop others from
putting. Same-host copies into and out of the arenas run inline (they are memcpy-speed).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .batch import Batch, BatchMeta
from .client import (
    _COMMIT_TRIES,
    _RPC_GRACE_S,
    ReadPlan,
    UnitHandle,
    _ints,
    ack_header,
    check_lease,
    check_ragged,
    encode_put,
    get_header,
    lease_deadline,
    put_header,
    refresh_units,
    stale_units,
    write_plan,
    writer_tag,
)
from .codec import copy_bytes
from .config import TransferQueueConfig
from .errors import ServerUnavailableError, TransferQueueError
from .protocol import RequestIds, Signer, decode, encode
from .transport import _check, _copy_frames, dealer_socket


class AsyncConnection:
    """DEALER connection with request multiplexing for asyncio."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, signer: Signer, name: str,
                 max_message_bytes: int):
        self.address, self.name, self.signer = address, name, signer
        self.sock, self.monitor = dealer_socket(ctx, address, max_message_bytes)
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._connected = False

    def _start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(self._read_loop()),
                           asyncio.ensure_future(self._monitor_loop())]

    async def _read_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            msg = decode(self.signer, frames)
            if msg is None:
                continue  # not authentic or garbage: drop
            fut = self._futures.get(msg[0].get("id"))
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and self._connected:
                error = ServerUnavailableError(f"{self.name} at {self.address} closed the connection "
                                               "while requests were pending (the process died or exited)")
                for fut in self._futures.values():
                    if not fut.done():
                        fut.set_exception(error)

    async def request(self, header: dict, buffers=(), timeout_s: float = 60.0) -> tuple[dict, list]:
        self._start()
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._futures[req_id] = fut
        try:
            frames = encode(self.signer, {**header, "id": req_id}, buffers)
            await self.sock.send_multipart(frames, copy=_copy_frames(frames))
            try:
                msg = await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                raise ServerUnavailableError(f"{self.name} at {self.address} did not answer "
                                             f"{header.get('op')} within {timeout_s:.1f} s") from None
            return _check(msg)
        finally:
            self._futures.pop(req_id, None)

    async def send_oneway(self, header: dict) -> None:
        await self.sock.send_multipart(encode(self.signer, {**header, "id": 0, "noreply": True}))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class AsyncTransferQueueClient:
    """asyncio twin of ``TransferQueueClient``; ``await connect()`` (or ``async with``) first."""

    def __init__(self, address: str, config: TransferQueueConfig | None = None, *, writer: str | None = None):
        """``writer``: see ``TransferQueueClient``."""
        self._rids = RequestIds()
        self.writer = writer_tag(writer, self._rids)
        """The tag sent with every put (its writer) and get (its reader)."""
        self.config = config or TransferQueueConfig()
        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._signer = Signer(self.config.secret)
        self._controller = AsyncConnection(self._ctx, address, self._signer, "controller",
                                           self.config.max_message_bytes)
        self._units: dict[int, UnitHandle] = {}
        self.moved_bytes = {"shm": 0, "socket": 0}
        """Payload bytes this client put and got through mapped arenas (same host) and through sockets."""

    async def _call(self, header: dict, timeout_s: float | None = None) -> dict:
        header = self._rids.stamp(header)
        return (await self._controller.request(header, (), timeout_s or self.config.rpc_timeout_s))[0]

    async def connect(self) -> AsyncTransferQueueClient:
        """Learn the storage units (waits while they are still registering)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.rpc_timeout_s
        while True:
            reply = await self._call({"op": "hello"})
            if reply.get("ready") or loop.time() > deadline:
                break
            await asyncio.sleep(0.02)
        refresh_units(self._units, reply["units"], self.config.shm_enabled)
        if not self._units:
            raise ServerUnavailableError(f"the controller at {self.address} has no storage units")
        return self

    async def _unit(self, uid: int) -> UnitHandle:
        if uid not in self._units:
            await self.connect()
        if uid not in self._units:
            raise TransferQueueError(f"storage unit {uid} is unknown to the controller")
        return self._units[uid]

    def _conn(self, unit: UnitHandle) -> AsyncConnection:
        if unit.conn is None:
            unit.conn = AsyncConnection(self._ctx, unit.address, self._signer, f"storage unit {unit.id}",
                                        self.config.max_message_bytes)
        return unit.conn

    def _use_shm(self, unit: UnitHandle, nbytes: int) -> bool:
        return unit.arena is not None and nbytes >= self.config.shm_threshold_bytes

    # ------------------------------------------------------------- operations
    async def create_partition(self, partition: str, *, fields=None, consumers=None, expected_rows=None,
                               auto_clear: bool = False, exist_ok: bool = False) -> bool:
        """See ``TransferQueueClient.create_partition``."""
        return (await self._call({"op": "create_partition", "partition": partition, "fields": fields,
                                  "consumers": consumers, "expected_rows": expected_rows,
                                  "auto_clear": auto_clear, "exist_ok": exist_ok}))["created"]

    async def seal(self, partition: str) -> int:
        """See ``TransferQueueClient.seal``."""
        return (await self._call({"op": "seal", "partition": partition}))["rows"]

    async def clear(self, partition: str, indexes=None, *, force: bool = False) -> int:
        """See ``TransferQueueClient.clear``."""
        return (await self._call({"op": "clear", "partition": partition, "indexes": _ints(indexes),
                                  "force": force}))["cleared"]

    async def status(self, partition: str | None = None) -> dict:
        """See ``TransferQueueClient.status``."""
        reply = await self._call({"op": "status", "partition": partition})
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def release(self, partition: str, task: str, indexes=None) -> int:
        """See ``TransferQueueClient.release``."""
        return (await self._call({"op": "release", "partition": partition, "task": task,
                                  "indexes": _ints(indexes)}))["released"]

    async def roll_back_puts(self, writer: str) -> int:
        """See ``TransferQueueClient.roll_back_puts``."""
        reply = await self._call({"op": "roll_back_puts", "writer": writer})
        return reply["rolled_back"] + reply["parked"]

    async def cancel_reads(self, reader: str) -> int:
        """See ``TransferQueueClient.cancel_reads``."""
        return (await self._call({"op": "cancel_reads", "reader": reader}))["cancelled"]

    async def put(self, partition: str, data: dict, *, indexes=None, versions=None, group_ids=None,
                  lengths=None, timeout: float | None = None) -> list[int]:
        """See ``TransferQueueClient.put``."""
        timeout = self.config.put_timeout_s if timeout is None else timeout
        encoded, count = encode_put(data, indexes, versions, group_ids, lengths)
        header = put_header(partition, encoded, count, indexes, versions, group_ids, lengths, timeout, self.writer)
        reply = await self._call(header, timeout + _RPC_GRACE_S)
        lease_end = lease_deadline(reply)
        try:
            if stale_units(self._units, reply.get("units")):
                await self.connect()
            waits = []
            for uid, items in write_plan(reply["chunks"], encoded).items():
                unit = await self._unit(uid)
                nbytes = sum(p.nbytes for _, p in items)
                self.moved_bytes["shm" if self._use_shm(unit, nbytes) else "socket"] += nbytes
                if self._use_shm(unit, nbytes):
                    for offset, piece in items:
                        check_lease(reply["put"], lease_end)
                        copy_bytes(unit.arena.view[offset:offset + piece.nbytes], piece)
                else:
                    waits.append(self._conn(unit).request(
                        {"op": "write", "ranges": [[o, p.nbytes] for o, p in items], "epoch": reply["put"]},
                        [p for _, p in items], self.config.rpc_timeout_s))
            await asyncio.gather(*waits)
            commit = self._rids.stamp({"op": "commit_put", "put": reply["put"]})
            for attempt in range(_COMMIT_TRIES):  # idempotent: a lost reply is asked for again
                try:
                    return (await self._call(commit))["indexes"]
                except ServerUnavailableError:
                    if attempt == _COMMIT_TRIES - 1:
                        raise
        except BaseException:
            try:
                await self._call({"op": "abort_put", "put": reply["put"]})
            except TransferQueueError:
                pass
            raise

    async def get_meta(self, partition: str, task: str, fields, batch_size: int, *,
                       sampler: str = "sequential", sampler_args: dict | None = None, dp_rank: int = 0,
                       dp_size: int = 1, mp_rank: int = 0, mp_size: int = 1, block: bool = True,
                       timeout: float | None = None, allow_partial: bool = False,
                       lease: float | None = None) -> BatchMeta:
        """See ``TransferQueueClient.get_meta``."""
        timeout = self.config.get_timeout_s if timeout is None else timeout
        header = get_header(partition, task, fields, batch_size, sampler, sampler_args, dp_rank, dp_size,
                            mp_rank, mp_size, timeout if block else None, allow_partial, lease, self.writer)
        reply = await self._call(header, (timeout if block else 0) + self.config.rpc_timeout_s)
        return BatchMeta.from_reply(partition, task, reply)

    async def renew(self, meta: BatchMeta, lease: float | None = None) -> int:
        """See ``TransferQueueClient.renew``."""
        if not meta.indexes:
            return 0
        return (await self._call({"op": "renew", "partition": meta.partition, "task": meta.task,
                                  "indexes": meta.indexes, "handout": meta.handout, "lease": lease}))["renewed"]

    async def get_data(self, meta: BatchMeta, fields=None, *, ragged: str = "list") -> Batch:
        """See ``TransferQueueClient.get_data``."""
        check_ragged(ragged)
        plan = ReadPlan(meta, fields)
        if stale_units(self._units, meta.units):
            await self.connect()
        reads = []
        for uid, items in plan.by_unit.items():
            unit = await self._unit(uid)
            nbytes = sum(size for _, size, _ in items)
            self.moved_bytes["shm" if self._use_shm(unit, nbytes) else "socket"] += nbytes
            if self._use_shm(unit, nbytes):
                for offset, size, dst in items:
                    copy_bytes(dst, unit.arena.view[offset:offset + size])
            else:
                reads.append((items, self._conn(unit).request(
                    {"op": "read", "ranges": [[o, s] for o, s, _ in items]}, (), self.config.rpc_timeout_s)))
        results = await asyncio.gather(*(r for _, r in reads))
        for (items, _), (_, buffers) in zip(reads, results):
            if len(buffers) != len(items):
                raise TransferQueueError("storage unit returned a wrong number of buffers")
            for (_, _, dst), buf in zip(items, buffers):
                dst[:] = memoryview(buf).cast("B")
        if meta.indexes:
            await self._controller.send_oneway(self._rids.stamp(ack_header(meta)))
        return plan.finish(meta, ragged)

    async def get(self, partition: str, task: str, fields, batch_size: int, *, ragged: str = "list",
                  **kwargs) -> Batch:
        """See ``TransferQueueClient.get``."""
        check_ragged(ragged)
        return await self.get_data(await self.get_meta(partition, task, fields, batch_size, **kwargs),
                                   ragged=ragged)

    async def poll(self, partition: str, task: str, fields, batch_size: int, *, ragged: str = "list",
                   **kwargs) -> Batch | None:
        """See ``TransferQueueClient.poll``."""
        meta = await self.get_meta(partition, task, fields, batch_size, block=False, **kwargs)
        if not meta.indexes and not meta.done:
            return None
        return await self.get_data(meta, ragged=ragged)

    async def iter_batches(self, partition: str, task: str, fields, batch_size: int, *,
                           ragged: str = "list", **kwargs) -> AsyncIterator[Batch]:
        """See ``TransferQueueClient.iter_batches``."""
        while True:
            batch = await self.get(partition, task, fields, batch_size, ragged=ragged, **kwargs)
            if batch.done:
                return
            yield batch

    def close(self) -> None:
        """Close sockets and unmap arenas."""
        self._controller.close()
        for unit in self._units.values():
            unit.close()
        self._units.clear()
        self._ctx.term()

    async def __aenter__(self) -> AsyncTransferQueueClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        self.close()
