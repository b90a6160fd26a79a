"""A storage unit: owns one arena of sample bytes and serves reads and writes of byte ranges.

The controller decides which ranges hold which rows; the unit only moves bytes. Same-host clients
map the arena and copy directly (the unit is not involved in their data path at all); remote clients,
or all clients when shared memory is off, send ``write`` and ``read`` requests with raw frames. The
unit registers with the controller and then sends heartbeats, which is how the controller notices a
unit that died and fails the requests that needed its rows instead of letting them hang.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from .config import TransferQueueConfig
from .errors import BadRequestError, StalePutError
from .protocol import Signer, decode, encode
from .shm import Arena, host_id
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
        self.membership = UnitMembership(self)

    def serve_forever(self) -> None:
        """Register with the controller, then serve until stopped; always releases the arena."""
        self.server.on_close.append(self.membership.stop)  # its sockets close before the context ends
        try:
            self.membership.register()  # before serving: a refused registration fails the start
            self.membership.start()
            self.server.serve_forever()
        finally:
            self.membership.stop()
            self.arena.close()

    def stop(self) -> None:
        self.server.stop()

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


class UnitMembership:
    """A storage unit's side of membership, on a thread of its own: registration, heartbeats, and
    registering again when the controller answers a heartbeat with ``rejoin`` (it had declared the unit
    dead). Off the unit's request thread, so that long writes never delay a heartbeat."""

    def __init__(self, unit: StorageUnit):
        self.unit = unit
        self.config = unit.config
        self.incarnation = -1
        self.rejoins = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tq-unit{unit.unit_id}-heartbeat",
                                        daemon=True)
        self._ctx = unit.server.ctx
        self._reg: zmq.Socket | None = None
        self._beat: zmq.Socket | None = None

    def register(self) -> None:
        """Register (again) and learn the fence link, the floor and where heartbeats go; raises on refusal
        or when the controller does not answer within ``rpc_timeout_s``."""
        if self._reg is None:
            self._reg = self._socket(self.unit.controller_address)
        u = self.unit
        header = {"op": "register_unit", "id": 1, "unit": u.unit_id, "address": u.address,
                  "arena": u.arena.name, "size": u.arena.size, "shm_host": host_id()}
        self._reg.send_multipart(encode(u.signer, header))
        deadline = time.monotonic() + self.config.rpc_timeout_s
        while time.monotonic() < deadline:
            if not self._reg.poll(100):
                continue
            msg = decode(u.signer, self._reg.recv_multipart())
            if msg is None or msg[0].get("id") != 1:
                continue
            reply = msg[0]
            if not reply.get("ok"):
                raise RuntimeError(f"storage unit {u.unit_id}: registration refused: {reply.get('msg')}")
            u.controller_link = bytes.fromhex(reply["link"])
            # Epochs placed on an earlier incarnation must never write into the new one's ranges.
            u.fence_floor = max(u.fence_floor, int(reply.get("floor", 0)))
            self.incarnation = int(reply["inc"])
            if self._beat is not None:
                self._beat.close(linger=0)
            self._beat = self._socket(reply["heartbeat"])
            return
        raise RuntimeError(f"storage unit {u.unit_id}: controller at {u.controller_address} did not answer "
                           "the registration")

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        for sock in (self._reg, self._beat):
            if sock is not None:
                sock.close(linger=0)
        self._reg = self._beat = None

    def _run(self) -> None:
        signer = self.unit.signer
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                header = {"op": "heartbeat", "id": 0, "unit": self.unit.unit_id, "inc": self.incarnation}
                self._beat.send_multipart(encode(signer, header), zmq.NOBLOCK)
                rejoin = False
                while self._beat.poll(0):
                    msg = decode(signer, self._beat.recv_multipart())
                    rejoin |= msg is not None and bool(msg[0].get("rejoin"))
                if rejoin:
                    logger.warning("storage unit %d: the controller declared it dead; registering again",
                                   self.unit.unit_id)
                    self.register()
                    self.rejoins += 1
            except zmq.Again:  # controller unreachable for now; it declares us dead if this lasts
                pass
            except zmq.ContextTerminated:
                return
            except (zmq.ZMQError, RuntimeError):
                if self._stop.is_set():
                    return
                logger.exception("storage unit %d: heartbeat failed", self.unit.unit_id)
