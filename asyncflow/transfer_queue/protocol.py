"""Wire format of every TransferQueue message.

A message is a ZMQ multipart message ``[tag, header, *buffers]``:

- ``tag``: keyed BLAKE2b (32 bytes) over the header and every buffer when a shared secret is
  configured, empty otherwise. BLAKE2b in keyed mode is a MAC by design, and cheaper than HMAC-SHA256.
- ``header``: a msgpack map with at least ``op`` (requests) or ``ok`` (replies) and ``id``.
- ``buffers``: raw bytes (tensor payloads); their meaning is described by the header.

Nothing here ever unpickles: a malformed message is reported as ``None`` and dropped by the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
from typing import Any

import msgpack

TAG_BYTES = 32
# Headers are small; these limits stop a hostile peer from making msgpack allocate gigabytes.
_MAX_HEADER_BYTES = 64 << 20


class Signer:
    """Computes and checks message tags for one shared secret (or does nothing without one)."""

    def __init__(self, secret: str | bytes | None):
        if isinstance(secret, str):
            secret = secret.encode()
        # Derive a fixed-size key so that secrets of any length are accepted by BLAKE2b (max 64 B).
        self._key = hashlib.sha256(b"asyncflow-tq:" + secret).digest() if secret else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def tag(self, frames: list) -> bytes:
        if self._key is None:
            return b""
        mac = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES)
        for frame in frames:
            view = memoryview(frame)
            # The length prefix binds frame boundaries, so frames cannot be re-split under one tag.
            mac.update(view.nbytes.to_bytes(8, "little"))
            mac.update(view)
        return mac.digest()

    def verify(self, tag, frames: list) -> bool:
        if self._key is None:
            return True
        tag = bytes(tag)
        return len(tag) == TAG_BYTES and hmac.compare_digest(tag, self.tag(frames))


def encode(signer: Signer, header: dict, buffers: list | tuple = ()) -> list:
    """Build the frames of one message."""
    head = msgpack.packb(header, use_bin_type=True)
    body = [head, *buffers]
    return [signer.tag(body), *body]


def decode(signer: Signer, frames: list) -> tuple[dict, list] | None:
    """Parse and authenticate one message; None when it is malformed or not authentic."""
    if len(frames) < 2:
        return None
    body = [_as_buffer(f) for f in frames[1:]]
    # Size caps first: an oversized header is refused before a byte of it is hashed or parsed.
    if memoryview(body[0]).nbytes > _MAX_HEADER_BYTES:
        return None
    if not signer.verify(_as_buffer(frames[0]), body):
        return None
    head = body[0]
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    if not isinstance(header, dict) or not isinstance(header.get("id", 0), int):
        return None
    return header, body[1:]


def _as_buffer(frame: Any):
    # zmq.Frame (copy=False receive) exposes .buffer; bytes and memoryviews pass through.
    return frame.buffer if hasattr(frame, "buffer") else frame


MUTATING_OPS = frozenset({"create_partition", "prepare_put", "commit_put", "abort_put", "roll_back_puts",
                          "cancel_reads", "get_meta", "renew", "ack", "release", "seal", "clear"})
"""Controller requests that change state. Clients give each a unique request id (``rid``); a retried or
duplicated request with an id the controller has seen gets the first answer and takes no effect twice."""


class RequestIds:
    """Unique request ids of one client: a random client prefix and a counter."""

    def __init__(self):
        self._prefix = secrets.token_hex(8)
        self._next = itertools.count(1)

    @property
    def prefix(self) -> str:
        """The random part shared by every request id of this client (unique per client)."""
        return self._prefix

    def stamp(self, header: dict) -> dict:
        """``header`` with a fresh ``rid`` when its op changes state (unchanged otherwise)."""
        if header.get("op") in MUTATING_OPS and "rid" not in header:
            return {**header, "rid": f"{self._prefix}.{next(self._next)}"}
        return header


def ok_reply(req_id: int, **fields) -> dict:
    """Header of a successful reply."""
    return {"id": req_id, "ok": True, **fields}


def error_reply(req_id: int, code: str, message: str) -> dict:
    """Header of a failed reply; the client raises the matching exception."""
    return {"id": req_id, "ok": False, "code": code, "msg": message}
