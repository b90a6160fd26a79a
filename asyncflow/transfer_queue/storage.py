"""A storage unit: owns one arena of sample bytes and serves reads and writes of byte ranges.

The controller decides which ranges hold which rows; the unit only moves bytes. Same-host clients
map the arena and copy directly (the unit is not involved in their data path at all); remote clients,
or all clients when shared memory is off, send ``write`` and ``read`` requests with raw frames. The
unit registers with the controller and then sends heartbeats, which is how the controller notices a
unit that died and fails the requests that needed its rows instead of letting them hang.
"""

from __future__ import annotations

import logging
import time

import zmq

from .config import TransferQueueConfig
from .errors import BadRequestError, StalePutError
from .protocol import Signer, decode, encode
from .shm import Arena
from .transport import Request, RpcServer
from .validation import check_int

logger = logging.getLogger(__name__)


class StorageUnit:
    """One storage unit server (run ``serve_forever`` on a thread or as a process's main loop)."""

    def __init__(self, unit_id: int, config: TransferQueueConfig, controller_address: str,
                 shm_prefix: str | None):
        config.validate()
        self.unit_id = unit_id
        self.config = config
        self.controller_address = controller_address
        name = f"{shm_prefix}-unit{unit_id}" if (config.shm_enabled and shm_prefix) else None
        self.arena = Arena.create(config.storage_unit_capacity_bytes, name)
        self.signer = Signer(config.secret)
        self.server = RpcServer(f"storage unit {unit_id}", config.host, 0, self.signer,
                                config.max_message_bytes, config.advertise_host,
                                config.receive_queue_messages)
        self.address = self.server.address
        self.server.handlers.update(write=self._op_write, read=self._op_read, fence=self._op_fence,
                                    ping=lambda req: {})
        # Fencing (see fencing.py): writes of closed epochs, or of any epoch below the floor, are refused.
        self.fence_floor = 0
        self.controller_link = b""  # routing id of the controller's fence connection, from registration
        self.closed_epochs: set[int] = set()
        self.refused_writes = 0
        self._heartbeat_sock: zmq.Socket | None = None

    def serve_forever(self) -> None:
        """Register with the controller, then serve until stopped; always releases the arena."""
        self.server.on_close.append(self._close_heartbeat)
        try:
            self._register()
            self.server.add_timer(self.config.heartbeat_interval_s, self._heartbeat)
            self.server.serve_forever()
        finally:
            self._close_heartbeat()
            self.arena.close()

    def _close_heartbeat(self) -> None:
        if self._heartbeat_sock is not None:
            self._heartbeat_sock.close(linger=0)
            self._heartbeat_sock = None

    def stop(self) -> None:
        self.server.stop()

    def _register(self) -> None:
        # Created on the serving thread: ZMQ sockets must stay on the thread that uses them.
        sock = self.server.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.controller_address)
        self._heartbeat_sock = sock
        header = {"op": "register_unit", "id": 1, "unit": self.unit_id, "address": self.address,
                  "arena": self.arena.name, "size": self.arena.size}
        sock.send_multipart(encode(self.signer, header))
        deadline = time.monotonic() + self.config.rpc_timeout_s
        while time.monotonic() < deadline:
            if sock.poll(100):
                msg = decode(self.signer, sock.recv_multipart())
                if msg is not None and msg[0].get("id") == 1:
                    if not msg[0].get("ok"):
                        raise RuntimeError(f"storage unit {self.unit_id}: registration refused: "
                                           f"{msg[0].get('msg')}")
                    link = msg[0].get("link")
                    self.controller_link = bytes.fromhex(link) if isinstance(link, str) else b""
                    return
        raise RuntimeError(f"storage unit {self.unit_id}: controller at {self.controller_address} "
                           "did not answer the registration")

    def _heartbeat(self) -> None:
        header = {"op": "heartbeat", "id": 0, "unit": self.unit_id, "noreply": True}
        try:
            self._heartbeat_sock.send_multipart(encode(self.signer, header), zmq.NOBLOCK)
        except zmq.Again:  # controller unreachable for now; it will declare us dead if it lasts
            pass

    def _ranges(self, req: Request) -> list[tuple[int, int]]:
        ranges = req.header.get("ranges")
        if not isinstance(ranges, list):
            raise BadRequestError("ranges must be a list of [offset, nbytes]")
        out = []
        total = 0
        for item in ranges:
            if not (isinstance(item, list) and len(item) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise BadRequestError("each range must be [offset, nbytes] integers")
            offset, nbytes = item
            if offset < 0 or nbytes < 0 or offset + nbytes > self.arena.size:
                raise BadRequestError(f"range [{offset}, {nbytes}] is outside the arena of "
                                      f"{self.arena.size} bytes")
            total += nbytes
            out.append((offset, nbytes))
        if total > self.config.max_message_bytes:
            raise BadRequestError("read larger than max_message_bytes; split it")
        return out

    def _op_fence(self, req: Request):
        """The controller closes epochs before it reuses their ranges; ours to refuse from now on."""
        if not self.controller_link or req.identity != self.controller_link:
            raise BadRequestError("fences are accepted from the controller's link only")
        floor = check_int(req.header, "floor", 0)
        epochs = req.header.get("epochs")
        if not isinstance(epochs, list) or not all(isinstance(e, int) and not isinstance(e, bool)
                                                   for e in epochs):
            raise BadRequestError("epochs must be a list of integers")
        if floor > self.fence_floor:
            self.fence_floor = floor
            self.closed_epochs = {e for e in self.closed_epochs if e >= floor}
        self.closed_epochs.update(e for e in epochs if e >= self.fence_floor)
        return {}

    def _op_write(self, req: Request):
        epoch = check_int(req.header, "epoch", 0)
        if epoch < self.fence_floor or epoch in self.closed_epochs:
            self.refused_writes += 1
            raise StalePutError(f"storage unit {self.unit_id}: write of put {epoch} refused: that put was "
                                "already committed or rolled back and its ranges may hold other rows")
        ranges = self._ranges(req)
        if len(ranges) != len(req.buffers):
            raise BadRequestError(f"write has {len(ranges)} ranges but {len(req.buffers)} buffers")
        for (_, nbytes), buf in zip(ranges, req.buffers):
            if memoryview(buf).nbytes != nbytes:
                raise BadRequestError(f"buffer of {memoryview(buf).nbytes} bytes for a range of {nbytes}")
        # Validate everything before the first byte is copied: a bad request changes nothing.
        view = self.arena.view
        for (offset, nbytes), buf in zip(ranges, req.buffers):
            view[offset:offset + nbytes] = memoryview(buf).cast("B")
        return {}

    def _op_read(self, req: Request):
        view = self.arena.view
        # Copied: the arena range may be freed and reused before ZMQ finishes sending a zero-copy frame.
        buffers = [bytes(view[offset:offset + nbytes]) for offset, nbytes in self._ranges(req)]
        return {}, buffers
