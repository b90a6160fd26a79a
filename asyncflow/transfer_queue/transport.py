"""ZMQ transport: a request loop for servers and request/reply connections for clients.

Servers own one ROUTER socket and a single thread, so their state needs no locks. Handlers either
return a reply at once or keep the request (``DEFERRED``) and answer later, which is how blocking
requests wait on the server without occupying a client round trip per poll. Clients use one DEALER
socket per server with request ids, so several requests can be in flight and stale replies (from a
request that already timed out) are recognised and dropped.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from .config import is_loopback
from .errors import (
    BadRequestError,
    ServerUnavailableError,
    TransferQueueError,
    error_from_reply,
)
from .protocol import Signer, decode, encode, error_reply, ok_reply

logger = logging.getLogger(__name__)

DEFERRED = object()
"""Returned by a handler that will answer the request later through ``RpcServer.reply``."""

# Frames below this size are cheaper to copy than to hand to ZMQ zero-copy (which needs a callback).
ZERO_COPY_MIN_BYTES = 64 << 10
_RECONNECT_GRACE_S = 2.0  # ZMQ redials every 100 ms: a peer still gone after this is down, not blipping
_ANSWERS_KEPT = 1 << 17  # first answers kept for retries, at most this many ...
_ANSWER_BYTES = 32 << 20  # ... and this many bytes of packed headers (a 64-row get_meta answer: about 1.7 kB)
_MAX_FRAMES = 1 << 16  # a write of many rows sends one frame per coalesced range; far below this


@dataclass
class Request:
    """One decoded request as a handler sees it."""

    identity: bytes
    id: int
    header: dict
    buffers: list


def resolve_advertise_host(host: str, advertise_host: str | None) -> str:
    """The address clients should dial for a server bound to ``host``."""
    if advertise_host:
        return advertise_host
    if host in ("0.0.0.0", "*", ""):
        return socket.gethostname()
    return host


class RpcServer:
    """A single-threaded ROUTER loop that dispatches requests to handlers by ``op``."""

    def __init__(self, name: str, host: str, port: int, signer: Signer, max_message_bytes: int,
                 advertise_host: str | None = None, receive_queue_messages: int = 10000):
        if not is_loopback(host) and not signer.enabled:
            raise ValueError(f"{name}: refusing to bind {host!r} (reachable from other machines) "
                             "without a shared secret")
        self.name = name
        self.signer = signer
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # Replies to a client that went away must not block or raise; ROUTER drops them.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        # Bounded: a flooding peer is held back by TCP flow control, not buffered without limit.
        self.sock.setsockopt(zmq.RCVHWM, receive_queue_messages)
        self.bind_host = bind_host = "*" if host in ("0.0.0.0", "") else host
        if port:
            self.sock.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{resolve_advertise_host(host, advertise_host)}:{self.port}"
        self.handlers: dict[str, Callable[[Request], object]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._extra: dict[zmq.Socket, Callable[[], None]] = {}
        self._timers: list[list] = []  # [interval_s, callback, next_due]
        self._stop = threading.Event()
        self.on_close: list[Callable[[], None]] = []  # e.g. closing extra sockets of self.ctx
        self.messages_received = 0
        self.dropped_messages = 0
        self.requests_served = 0
        self.duplicate_requests = 0
        # rid -> ["pending", Request] or ["done", packed reply header or None]: the first answer to every
        # request that carried a request id, so that a retry or a duplicated message takes no effect twice.
        # Headers are kept packed (msgpack bytes, as sent): kept as dicts of Python objects, the 6,150 answers of
        # a 32k-row stream read by five tasks held about 30 MiB more of the controller's memory.
        self._answers: OrderedDict[str, list] = OrderedDict()
        self._answer_bytes = 0

    def add_timer(self, interval_s: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the server thread about every ``interval_s`` seconds."""
        self._timers.append([interval_s, callback, time.monotonic() + interval_s])

    def add_socket(self, sock: zmq.Socket, on_readable: Callable[[], None]) -> None:
        """Also poll ``sock`` (of ``self.ctx``) and call ``on_readable`` on the server thread."""
        self._extra[sock] = on_readable
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        if self._extra.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def reply(self, identity: bytes, header: dict, buffers: list | tuple = ()) -> bytes:
        """Send a reply header (built with ok_reply / error_reply) to one client; returns the packed header."""
        frames = encode(self.signer, header, buffers)
        try:
            self.sock.send_multipart([identity, *frames], copy=_copy_frames(frames))
        except zmq.ZMQError as exc:  # peer gone; nothing to do
            logger.debug("%s: reply dropped: %s", self.name, exc)
        return frames[1]

    def reply_ok(self, req: Request, buffers: list | tuple = (), **fields) -> None:
        self._remember(req, self.reply(req.identity, ok_reply(req.id, **fields), buffers))

    def reply_error(self, req: Request, exc: TransferQueueError) -> None:
        self._remember(req, self.reply(req.identity, error_reply(req.id, exc.code, str(exc))))

    def _remember(self, req: Request, packed: bytes | None) -> None:
        rid = _rid(req.header)
        if rid is None:
            return
        old = self._answers.pop(rid, None)
        if old is not None and old[0] == "done" and old[1] is not None:
            self._answer_bytes -= len(old[1])
        self._answers[rid] = ["done", packed]
        self._answer_bytes += 0 if packed is None else len(packed)
        while len(self._answers) > _ANSWERS_KEPT or self._answer_bytes > _ANSWER_BYTES:
            _, (state, value) = self._answers.popitem(last=False)
            if state == "done" and value is not None:
                self._answer_bytes -= len(value)

    def _answer_again(self, req: Request) -> bool:
        """True when ``req`` repeats a request id already seen (answered now, or redirected if parked)."""
        if req.header.get("rid") is not None and _rid(req.header) is None:
            raise BadRequestError("rid must be a string of at most 64 characters")
        rid = _rid(req.header)
        if rid is None:
            return False
        seen = self._answers.get(rid)
        if seen is None:
            return False
        self.duplicate_requests += 1
        if seen[0] == "pending":  # still parked: its eventual answer goes to this, the latest, copy
            seen[1].identity, seen[1].id = req.identity, req.id
        elif seen[1] is not None and not req.header.get("noreply"):
            header = msgpack.unpackb(seen[1], raw=False)
            self.reply(req.identity, {**header, "id": req.id})
        return True

    def stop(self) -> None:
        """Ask the loop to exit; it does within about 50 ms."""
        self._stop.set()

    def serve_forever(self) -> None:
        """Run until ``stop``; closes the socket on exit."""
        try:
            while not self._stop.is_set():
                wait_s = 0.05
                if self._timers:
                    wait_s = max(0.0, min(wait_s, min(t[2] for t in self._timers) - time.monotonic()))
                for sock, _ in self._poller.poll(int(wait_s * 1000)):
                    if sock is self.sock:
                        self._drain()
                    else:
                        callback = self._extra.get(sock)
                        try:
                            if callback is not None:
                                callback()
                        except Exception:  # a bug there must not take the server down
                            logger.exception("%s: socket handler failed", self.name)
                self._run_timers()
        finally:
            for callback in self.on_close:
                callback()
            for sock in list(self._extra):
                sock.close(linger=0)
            self.sock.close(linger=0)
            self.ctx.term()

    def _drain(self) -> None:
        # Bounded so that timers still run under a flood of requests.
        for _ in range(256):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _run_timers(self) -> None:
        now = time.monotonic()
        for timer in self._timers:
            if now >= timer[2]:
                timer[2] = now + timer[0]
                try:
                    timer[1]()
                except Exception:  # a timer bug must not take the server down
                    logger.exception("%s: timer failed", self.name)

    def _handle(self, frames: list) -> None:
        self.messages_received += 1
        identity = frames[0].bytes
        # ZMQ's MAXMSGSIZE caps each frame; cap the whole message (and its frame count) here, before
        # decode hashes a byte of it.
        if len(frames) > _MAX_FRAMES or sum(len(f) for f in frames) > self.max_message_bytes:
            self.dropped_messages += 1
            return
        msg = decode(self.signer, frames[1:])
        if msg is None:
            # Unauthenticated or malformed: drop silently, an attacker learns nothing.
            self.dropped_messages += 1
            return
        header, buffers = msg
        req = Request(identity, header.get("id", 0), header, buffers)
        op = header.get("op")
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            valid = ", ".join(sorted(self.handlers))
            self.reply_error(req, BadRequestError(f"{self.name}: unknown op {op!r}; valid ops: {valid}"))
            return
        self.requests_served += 1
        try:
            if self._answer_again(req):
                return
            result = handler(req)
        except TransferQueueError as exc:
            self.reply_error(req, exc)
            return
        except Exception as exc:  # malformed-but-authentic input must never kill the server
            logger.debug("%s: %s failed", self.name, op, exc_info=True)
            self.reply_error(req, BadRequestError(f"{self.name}: invalid {op} request: "
                                                  f"{type(exc).__name__}: {exc}"))
            return
        if result is DEFERRED or header.get("noreply"):
            rid = _rid(header)
            if rid is not None and rid not in self._answers:
                if result is DEFERRED and not header.get("noreply"):
                    self._answers[rid] = ["pending", req]
                else:
                    self._remember(req, None)
            return
        fields, buffers = result if isinstance(result, tuple) else (result or {}, ())
        self.reply_ok(req, buffers, **fields)


def _rid(header: dict) -> str | None:
    """The request id of a header when it is a valid one (untrusted input: anything else is None)."""
    rid = header.get("rid")
    return rid if isinstance(rid, str) and len(rid) <= 64 else None


def _copy_frames(frames: list) -> bool:
    return not any(memoryview(f).nbytes >= ZERO_COPY_MIN_BYTES for f in frames)


def dealer_socket(ctx, address: str, max_message_bytes: int):
    """A connected client DEALER socket and its monitor socket (``ctx``: a sync or asyncio context).

    The monitor tells the client at once when the peer's process is gone, so waits fail in
    milliseconds instead of running into the RPC timeout.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    return sock, monitor


class Connection:
    """A client's DEALER connection to one server; not thread-safe (the client holds a lock)."""

    def __init__(self, ctx: zmq.Context, address: str, signer: Signer, name: str,
                 max_message_bytes: int):
        self.address = address
        self.name = name
        self.signer = signer
        self.sock, self.monitor = dealer_socket(ctx, address, max_message_bytes)
        self.connected = False
        self.lost = False  # the peer went away and has not come back (yet)
        self.disconnects = 0
        self.lost_since = 0.0
        self._sent_at: dict[int, int] = {}  # request id -> disconnects when it was sent
        self._ids = itertools.count(1)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self._early: dict[int, tuple[dict, list]] = {}

    def send(self, header: dict, buffers: list | tuple = ()) -> int:
        """Send one request and return its id."""
        req_id = next(self._ids)
        frames = encode(self.signer, {**header, "id": req_id}, buffers)
        if not header.get("noreply"):
            self._read_monitor()  # connection state as of this send
            self._sent_at[req_id] = self.disconnects
        self.sock.send_multipart(frames, copy=_copy_frames(frames))
        return req_id

    def recv(self, req_id: int, timeout_s: float, what: str = "") -> tuple[dict, list]:
        """Wait for the reply to ``req_id``; raise the server's error or ServerUnavailableError."""
        sent_at = self._sent_at.pop(req_id, self.disconnects)
        if req_id in self._early:
            return _check(self._early.pop(req_id))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerUnavailableError(
                    f"{self.name} at {self.address} did not answer {what or 'a request'} "
                    f"within {timeout_s:.1f} s")
            for sock, _ in self._poller.poll(int(min(left, 0.5) * 1000) + 1):
                if sock is self.monitor:
                    self._read_monitor()
                    continue
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = decode(self.signer, frames)
                    if msg is None:
                        continue  # not authentic or garbage: drop
                    rid = msg[0].get("id")
                    if rid == req_id:
                        return _check(msg)
                    if isinstance(rid, int) and rid > req_id:
                        self._early[rid] = msg  # in-flight request answered out of order
            # A disconnect after this request was sent fails it, and so does a peer that has been gone
            # for a while; a connection that dropped and came back (a restarted server, a network blip)
            # serves new requests normally.
            if self.disconnects != sent_at or (
                    self.lost and time.monotonic() - self.lost_since > _RECONNECT_GRACE_S):
                raise ServerUnavailableError(
                    f"{self.name} at {self.address} closed the connection while {what or 'a request'} "
                    "was pending (the process died or exited)")

    def request(self, header: dict, buffers: list | tuple = (), timeout_s: float = 60.0
                ) -> tuple[dict, list]:
        """Send a request and wait for its reply."""
        return self.recv(self.send(header, buffers), timeout_s, header.get("op", ""))

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
                self.lost = False
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost = True
                self.lost_since = time.monotonic()
                self.disconnects += 1

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def _check(msg: tuple[dict, list]) -> tuple[dict, list]:
    header, buffers = msg
    if header.get("ok"):
        return header, buffers
    raise error_from_reply(str(header.get("code", "error")), str(header.get("msg", "")))
