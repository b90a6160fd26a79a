"""Storage-unit membership on the controller: registration, heartbeats, death and rejoining.

Heartbeats arrive on a socket of their own, read by a thread that does nothing else (it records when
each unit was last heard of), so that a controller busy with a flood of requests never mistakes a
healthy unit for a dead one. The request thread compares those times with ``heartbeat_timeout_s``,
counting a unit's silence only while the controller was listening: up to the last time the listener had
read every heartbeat waiting on its socket, and from no earlier than the end of the controller's own
last pause. A pause of the whole machine (swapping, an overloaded host) stops the units and the controller
alike; counting it as the units' silence would declare healthy units dead and lose their rows.

Silence is the slow evidence, kept for a unit whose host or network is gone: a busy host delays heartbeats by
seconds (a unit paged out, descheduled, or its heartbeat thread waiting for the interpreter lock behind a long
copy), so ``heartbeat_timeout_s`` is generous. A unit whose process died is known much sooner and for sure:
the kernel closes its sockets, and the controller's link to it (the fence connection, watched with a ZMQ socket
monitor) reports the disconnection; a unit disconnected for ``LINK_GRACE_S`` without reconnecting is dead. A
stopped or starved process keeps its connections, so only silence beyond the timeout can declare it dead.

A unit declared dead (its process died, or it was silent too long: a pause, swapping) loses its rows
for good: waiters were already told, the partition went on without them, and rows may have been
cleared or rolled back since, so the controller cannot tell which of the unit's ranges still hold
valid rows. A unit that is in fact alive hears ``rejoin`` in reply to its next heartbeat and registers
again, as a new *incarnation* with an empty allocator; the ranges its old incarnation lent out are kept
out of use until no writer of that time can still hold them (fencing.py). A restarted unit process
registers the same way with a fresh arena. Clients learn incarnations from replies and reconnect.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from .errors import BadRequestError, StorageUnitError
from .fencing import COPY_GRACE_S
from .protocol import decode, encode
from .shm import RangeAllocator, valid_arena_name
from .transport import Request
from .validation import check_int

logger = logging.getLogger(__name__)

LINK_GRACE_S = 1.0
"""A unit whose link stays disconnected this long (no reconnect) is dead: its process closed its sockets."""


@dataclass
class Unit:
    """A storage unit (one incarnation of it) as the controller knows it."""

    id: int
    address: str
    arena: str | None
    size: int
    alloc: RangeAllocator
    registered: float
    incarnation: int = 0
    shm_host: str = ""  # the unit's ``shm.host_id()``: clients map its arena only when theirs is the same
    alive: bool = True
    link: object = None  # zmq DEALER to the unit, for fences
    link_id: bytes = b""
    retiring: list = field(default_factory=list)  # [(offset, size, epoch, not_before)]
    retiring_bytes: int = 0
    fence_seq: int = 0
    fence_inflight: list | None = None
    fence_sent: float = 0.0
    monitor: object = None  # ZMQ socket monitor of ``link``: connection and disconnection events
    disconnected: float | None = None  # when ``link`` lost its connection (None: connected)


class HeartbeatListener:
    """A thread that records heartbeats (incarnation -> last time heard) and answers dead ones."""

    def __init__(self, ctx: zmq.Context, server, pause_s: float):
        """``pause_s``: a gap this long between two turns of the listener's loop (which otherwise turns every
        0.1 s) means the controller's process was not running."""
        self.heard: dict[int, float] = {}
        self.alive: frozenset[int] = frozenset()  # replaced (never mutated) by the request thread
        self.pause_s = pause_s
        now = time.monotonic()
        self.caught_up = now  # when the listener last found its socket empty (every heartbeat sent was read)
        self.resumed = now  # when the controller's process last came back from a pause
        self._signer = server.signer
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        host = server.bind_host
        self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = server.address.rsplit(":", 1)[0] + f":{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tq-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.sock.close(linger=0)

    def _run(self) -> None:
        turned = time.monotonic()
        while not self._stop.is_set():
            ready = self.sock.poll(100)
            now = time.monotonic()
            if now - turned > self.pause_s:
                self.resumed = now
            turned = now
            if not ready:
                self.caught_up = now
                continue
            frames = self.sock.recv_multipart(copy=False)
            msg = decode(self._signer, frames[1:])
            if msg is None:
                continue
            inc = msg[0].get("inc")
            if not isinstance(inc, int):
                continue
            if inc in self.alive:
                self.heard[inc] = time.monotonic()
            else:  # declared dead (or unknown): tell it to register again
                self.sock.send_multipart([frames[0].bytes, *encode(self._signer, {"id": 0, "rejoin": True})])


class MembershipHandlers:
    """Mixin of ``Controller``: hello, register_unit, unit deaths (uses its units, server, partitions)."""

    def _op_hello(self, req: Request):
        units = [[u.id, u.address, u.arena, u.size, u.alive, u.incarnation, u.shm_host] for u in self.units.values()]
        return {"units": units, "expected_units": self.config.num_storage_units,
                "ready": len(self.units) >= self.config.num_storage_units}

    def _op_register_unit(self, req: Request):
        h = req.header
        uid = check_int(h, "unit", 0)
        size = check_int(h, "size", 1)
        arena = h.get("arena")
        if arena is not None and not valid_arena_name(arena):
            # Clients join this name onto /dev/shm and map the file read-write: "../x" or "/x" would
            # make every client map a file of the attacker's choice.
            raise BadRequestError(f"arena must be a plain file name (letters, digits, '.', '_', '-'; "
                                  f"no separators), got {arena!r}")
        address = h.get("address")
        if not isinstance(address, str):
            raise BadRequestError("address must be a string")
        old = self.units.get(uid)
        if old is not None and old.alive:
            raise BadRequestError(f"storage unit {uid} is already registered")
        shm_host = h.get("shm_host", "")
        if not isinstance(shm_host, str):
            raise BadRequestError("shm_host must be a string")
        unit = Unit(uid, address, arena, size, RangeAllocator(size), time.monotonic(), next(self._ids), shm_host)
        if old is not None:
            self._unwatch_link(old)
            self._unlink_unit(old)
            if old.arena == arena and old.address == address:
                # The same process, wrongly declared dead: writers of its old incarnation may still copy
                # into its arena. Nothing of it is lent out before their leases are over.
                offset = unit.alloc.alloc(size)
                block = [uid, offset, size, 0, self._epoch_high]
                unit.retiring.append((offset, size, block[4], time.monotonic() + self.config.put_lease_s
                                      + COPY_GRACE_S))
                unit.retiring_bytes += size
            logger.warning("storage unit %d rejoined as incarnation %d; the rows of its previous "
                           "incarnation stay lost", uid, unit.incarnation)
        self.units[uid] = unit
        self._link_unit(unit)
        self._watch_link(unit)
        self.heartbeats.alive = frozenset(u.incarnation for u in self.units.values() if u.alive)
        logger.info("storage unit %d registered at %s", uid, address)
        # floor: every epoch so far is closed for this incarnation (none of them was placed on it).
        return {"link": unit.link_id.hex(), "inc": unit.incarnation, "heartbeat": self.heartbeats.address,
                "floor": self._epoch_high + 1}

    def _check_units(self, now: float) -> None:
        # Silence counts up to the last time the listener had read everything (after a pause of this process
        # the request thread may run before the listener has read the heartbeats waiting for it), and from
        # the end of the listener's last pause at the earliest (the units may have been paused with it).
        listening = self.heartbeats
        for unit in list(self.units.values()):
            last = max(listening.heard.get(unit.incarnation, unit.registered), listening.resumed)
            if unit.alive and listening.caught_up - last > self.config.heartbeat_timeout_s:
                self._unit_died(unit)
            elif unit.alive and unit.disconnected is not None and now - unit.disconnected > LINK_GRACE_S:
                self._unit_died(unit, "closed its connections (its process exited)")

    def _watch_link(self, unit: Unit) -> None:
        """Watch the unit's link for disconnection (``LINK_GRACE_S``), on the server loop like the link itself."""
        unit.monitor = unit.link.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        unit.monitor.setsockopt(zmq.LINGER, 0)
        self.server.add_socket(unit.monitor, lambda: self._on_link_event(unit))

    def _unwatch_link(self, unit: Unit) -> None:
        if unit.monitor is None:
            return
        self.server.remove_socket(unit.monitor)
        if unit.link is not None:
            unit.link.disable_monitor()
        unit.monitor.close(linger=0)
        unit.monitor = None

    def _on_link_event(self, unit: Unit) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while unit.monitor is not None:
            try:
                event = recv_monitor_message(unit.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                unit.disconnected = unit.disconnected or time.monotonic()
            elif event == zmq.EVENT_CONNECTED:
                unit.disconnected = None

    def _unit_died(self, unit: Unit, how: str = "stopped sending heartbeats") -> None:
        unit.alive = False
        self._unwatch_link(unit)
        self._unlink_unit(unit)
        self.heartbeats.alive = frozenset(u.incarnation for u in self.units.values() if u.alive)
        logger.error("storage unit %d at %s %s; its rows are lost", unit.id, unit.address, how)
        for part in self.partitions.values():
            for f in part.fields.values():
                n = part.n
                on_unit = np.flatnonzero((f.unit[:n] == unit.id) & (f.produced[:n] | f.pending[:n]))
                if len(on_unit):
                    part.mark_lost(on_unit)
        # Blocks on the dead incarnation are gone with its allocator.
        for block_id in [k for k, b in self.blocks.items() if b[0] == unit.id]:
            del self.blocks[block_id]
        # Wake every parked get: a sealed partition whose missing rows were lost now ends with a final
        # partial batch; others keep waiting for rows from the surviving units.
        for name in {p.partition for p in self.parked_gets}:
            self._wake_gets(name)

    def _lost_error(self, part) -> StorageUnitError:
        dead = sorted(u.id for u in self.units.values() if not u.alive)
        return StorageUnitError(f"storage unit(s) {dead or 'that held them'} died; {part.lost_rows} rows of "
                                f"partition {part.name!r} were lost with them (the partition's other rows "
                                "stay readable; clear the lost ones to free their row budget)")

    def _incarnations(self, units) -> dict[str, int]:
        """Incarnation of each named unit, for replies: clients reconnect when one changed."""
        return {str(u): self.units[u].incarnation for u in set(units) if u in self.units}
