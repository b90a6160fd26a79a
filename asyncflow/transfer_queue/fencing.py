"""Write fencing: an arena range is reused only once no writer can still write into it.

Every put is an epoch (its id, increasing). Its writes carry the epoch, and the storage unit refuses
a write whose epoch the controller has closed (committed or rolled back) or that lies below the
*floor*, the oldest put still pending. A range freed by a clear, an auto-clear or a rollback first goes
to its unit's retiring list; the controller sends the unit a ``fence`` naming the epochs of those
ranges, and only when the unit has answered (so every later write of those epochs is refused) does the
range go back to the allocator. Writes a unit handled before the fence landed before the range was
reused, so a late or duplicated ``write`` message can no longer overwrite the next put's bytes.

Same-host writers copy straight into the mapped arena, past the unit. They check their put's lease
before each copy and never start one after it; a pending put rolled back by someone else (a force
clear, the lease timer) therefore retires its ranges only after its lease deadline plus a grace for a
copy already under way.
"""

from __future__ import annotations

import logging
import secrets
import time

import zmq

from .protocol import decode, encode

logger = logging.getLogger(__name__)

COPY_GRACE_S = 1.0
"""Time a same-host copy that started just before its lease ended may still take (a few GiB)."""


class FenceHandlers:
    """Mixin of ``Controller``: links to the storage units, retiring ranges and fences."""

    def _link_unit(self, unit) -> None:
        # The controller is a client of each unit for fences. Its own socket, polled by the server loop,
        # so that fences never wait behind client requests on the controller's ROUTER.
        sock = self.server.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A random routing id, told only to the unit: it accepts fences from this connection alone, so a
        # client (which holds the secret too) cannot fence epochs and stop every later write.
        unit.link_id = b"ctl-" + secrets.token_bytes(16)
        sock.setsockopt(zmq.ROUTING_ID, unit.link_id)
        sock.connect(unit.address)
        unit.link = sock
        self.server.add_socket(sock, lambda: self._on_fence_reply(unit))

    def _unlink_unit(self, unit) -> None:
        if unit.link is not None:
            self.server.remove_socket(unit.link)
            unit.link.close(linger=0)
            unit.link = None
        unit.retiring.clear()
        unit.fence_inflight = None

    def _retire(self, block: list, not_before: float = 0.0) -> None:
        """Queue a block's range for reuse once its unit has fenced the block's epoch."""
        unit = self.units.get(block[0])
        if unit is None or not unit.alive:
            return
        unit.retiring.append((block[1], block[2], block[4], not_before))
        unit.retiring_bytes += block[2]
        self._send_fence(unit)

    def _fence_floor(self) -> int:
        return min(self.puts, default=self._epoch_high + 1)

    def _send_fence(self, unit, resend: bool = False) -> None:
        if unit.link is None or (unit.fence_inflight is not None and not resend):
            return
        if unit.fence_inflight is None:
            now = time.monotonic()
            ready = [r for r in unit.retiring if r[3] <= now]
            if not ready:
                return
            unit.retiring = [r for r in unit.retiring if r[3] > now]
            unit.fence_seq += 1
            unit.fence_inflight = ready
        unit.fence_sent = time.monotonic()
        epochs = sorted({r[2] for r in unit.fence_inflight})
        header = {"op": "fence", "id": unit.fence_seq, "floor": self._fence_floor(), "epochs": epochs}
        try:
            unit.link.send_multipart(encode(self.server.signer, header), zmq.NOBLOCK)
        except zmq.ZMQError:  # resent by the timer
            pass

    def _on_fence_reply(self, unit) -> None:
        while unit.link is not None:
            try:
                frames = unit.link.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode(self.server.signer, frames)
            if msg is None or not msg[0].get("ok") or msg[0].get("id") != unit.fence_seq:
                continue
            if unit.fence_inflight is None:
                continue
            for offset, size, _, _ in unit.fence_inflight:
                unit.alloc.free(offset, size)
                unit.retiring_bytes -= size
            unit.fence_inflight = None
            self._send_fence(unit)
            self._wake_puts()

    def _fence_timer(self) -> None:
        now = time.monotonic()
        for unit in self.units.values():
            if not unit.alive:
                continue
            if unit.fence_inflight is not None and now - unit.fence_sent > 1.0:
                self._send_fence(unit, resend=True)  # lost, or the unit was busy: same fence again
            else:
                self._send_fence(unit)
