"""Malformed, truncated and unauthenticated frames straight at the sockets; a server that answers
garbage. Servers must survive and keep serving; clients must fail with an error, never hang."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch
import zmq

from asyncflow.transfer_queue import ServerUnavailableError, StalePutError, TransferQueueClient, TransferQueueConfig
from asyncflow.transfer_queue.protocol import Signer, encode
from asyncflow.transfer_queue.transport import Connection

OPS = ["hello", "register_unit", "heartbeat", "create_partition", "prepare_put", "commit_put", "abort_put",
       "roll_back_puts", "cancel_reads", "get_meta", "renew", "ack", "release", "seal", "clear", "status", "read",
       "write", "fence", "ping", "nonsense"]
KEYS = ["partition", "task", "fields", "batch_size", "indexes", "count", "put", "unit", "address", "size",
        "sampler", "sampler_args", "dp_rank", "dp_size", "mp_rank", "mp_size", "timeout", "ranges",
        "versions", "group_ids", "lengths", "expected_rows", "consumers", "force", "exist_ok", "arena",
        "epoch", "epochs", "floor", "handout", "lease", "rid", "inc", "writer", "reader"]


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "int", "bigint", "neg", "float", "str", "bytes", "bool"]
    if depth < 2:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "int":
        return rng.randint(0, 70)
    if kind == "bigint":
        return rng.choice([2**63 - 1, 2**40, 10**18])
    if kind == "neg":
        return -rng.randint(1, 2**40)
    if kind == "float":
        return rng.choice([0.5, -1.0, float("nan"), float("inf"), 1e300])
    if kind == "str":
        return rng.choice(["", "x", "zz", "dense", "float32", "sequential", "group", "tcp://x", "ids"])
    if kind == "bytes":
        return rng.randbytes(rng.randint(0, 16))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(KEYS): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def malformed_message(rng: random.Random, signer: Signer, real: list[bytes]) -> list[bytes]:
    """One of: random frames, random headers for real ops, a truncated real message, a bad tag."""
    choice = rng.random()
    if choice < 0.25:
        return [rng.randbytes(rng.randint(0, 48)) for _ in range(rng.randint(1, 5))]
    if choice < 0.65:
        header = {k: random_value(rng) for k in rng.sample(KEYS, rng.randint(0, 8))}
        header["op"] = rng.choice(OPS)
        if header["op"] in ("read", "write", "ping") or header.get("partition") == "keep":
            header["partition"] = "fuzz"
        header["id"] = rng.choice([rng.randint(0, 1 << 30), -5, "x", None])
        try:
            frames = encode(signer, header, [rng.randbytes(rng.randint(0, 8))] * rng.randint(0, 3))
        except (TypeError, ValueError, OverflowError):
            return [b"\xc1"]
        return frames
    if choice < 0.9:
        frames = list(real)
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randint(0, max(0, len(frames[i]) - 1))]
        return frames
    frames = list(real)
    frames[0] = rng.randbytes(32)  # forged tag
    return frames


def real_ops(real: list[bytes]) -> str:
    return "ping" if b"read" in real[1] else "status"


def _reply_id(frames: list[bytes]):
    try:
        return msgpack.unpackb(frames[1]).get("id")
    except Exception:
        return None


def fuzz_socket(address: str, signer: Signer, real: list[bytes], count: int, seed: int) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for _ in range(count):
            sock.send_multipart(malformed_message(rng, signer, real))
            while sock.poll(0):  # drain error replies so nothing piles up
                sock.recv_multipart()
        # Messages on one connection are handled in order: once this is answered, all were handled.
        sock.send_multipart(encode(signer, {"op": real_ops(real), "id": 424242}))
        while True:
            assert sock.poll(20000), "server stopped answering"
            frames = sock.recv_multipart()
            if _reply_id(frames) == 424242:
                break
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_fuzz_controller_and_storage_units(make_tq, secret):
    tq = make_tq(secret=secret)
    config = tq.config
    with tq.client() as client:
        client.create_partition("keep")
        payload = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
        client.put("keep", {"x": payload, "tok": [torch.arange(i) for i in range(64)]})
        signer = Signer(secret)
        real_put = encode(signer, {"op": "prepare_put", "id": 7, "partition": "fuzz", "count": 1,
                                   "fields": {"x": [["dense", "float32", [2]], [8], None]}})
        fuzz_socket(tq.address, signer, real_put, 2000, seed=1)
        real_read = encode(signer, {"op": "read", "id": 3, "ranges": [[0, 16]]})
        # A well-formed write of a put that never existed (epoch 0 is below every unit's floor).
        real_write = encode(signer, {"op": "write", "id": 4, "epoch": 0, "ranges": [[0, 8]]}, [b"\xff" * 8])
        for i, unit in enumerate(tq.units):
            fuzz_socket(unit.address, signer, real_read, 400, seed=10 + i)
            fuzz_socket(unit.address, signer, real_write, 400, seed=20 + i)
            # The well-formed one itself is refused: a write of an epoch the unit never opened is stale.
            ctx = zmq.Context()
            conn = Connection(ctx, unit.address, signer, "unit", 1 << 20)
            try:
                with pytest.raises(StalePutError):
                    conn.request({"op": "write", "epoch": 0, "ranges": [[0, 8]]}, [b"\xff" * 8], timeout_s=20)
            finally:
                conn.close()
                ctx.term()
        assert tq.controller.server.messages_received > 2000  # every fuzz message reached the server
        # Everything still works and the data is intact.
        batch = client.get("keep", "after-fuzz", ["x", "tok"], 64)
        assert torch.equal(batch["x"], payload)
        assert all(torch.equal(t, torch.arange(i)) for i, t in enumerate(batch["tok"]))
        assert client.status()["partitions"]["keep"]["live_rows"] == 64
        if secret:
            assert client.status()["dropped_messages"] > 1000  # nothing unauthenticated got through
        # Storage units still answer inline reads and writes too.
        no_shm = TransferQueueConfig(**{**vars(config), "shm_enabled": False})
        with TransferQueueClient(tq.address, no_shm) as inline:
            inline.put("keep", {"x": payload[:2], "tok": [torch.arange(3)] * 2})
            assert torch.equal(inline.get("keep", "inline", ["x"], 66)["x"][:64], payload)


def test_unauthenticated_client_is_ignored(make_tq):
    tq = make_tq(secret="right")
    wrong = TransferQueueConfig(**{**vars(tq.config), "secret": "wrong", "rpc_timeout_s": 0.5})
    with pytest.raises(ServerUnavailableError, match="did not answer"):
        TransferQueueClient(tq.address, wrong)
    none = TransferQueueConfig(**{**vars(tq.config), "secret": None, "rpc_timeout_s": 0.5})
    with pytest.raises(ServerUnavailableError):
        TransferQueueClient(tq.address, none)
    with tq.client() as client:
        assert client.status()["dropped_messages"] >= 2


def test_client_never_hangs_on_a_garbage_server():
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    rng = random.Random(0)
    config = TransferQueueConfig(rpc_timeout_s=1.0)
    import threading

    stop = threading.Event()

    def answer_garbage():
        while not stop.is_set():
            if server.poll(50):
                identity, *frames = server.recv_multipart()
                for _ in range(3):
                    reply = rng.choice([[b"", msgpack.packb([1, 2])], [rng.randbytes(9)], [b"", b"\xc1\xff"],
                                        [b"", msgpack.packb({"id": "x", "ok": True})], frames[:1]])
                    server.send_multipart([identity, *reply])

    thread = threading.Thread(target=answer_garbage)
    thread.start()
    try:
        with pytest.raises(ServerUnavailableError, match="did not answer hello"):
            TransferQueueClient(f"tcp://127.0.0.1:{port}", config)
    finally:
        stop.set()
        thread.join()
        server.close(linger=0)
        ctx.term()


def test_connection_recovers_after_the_server_comes_back():
    """A dropped and re-established connection serves new requests (the client's 'lost' state once
    stuck, so every later call failed within half a second); a request pending across the drop fails."""
    from asyncflow.transfer_queue.protocol import decode
    from asyncflow.transfer_queue.transport import Connection

    signer = Signer("s")
    ctx = zmq.Context()

    def echo_server(port=0):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return sock, port
        return sock, sock.bind_to_random_port("tcp://127.0.0.1")

    def answer(sock):
        assert sock.poll(20000)
        identity, *frames = sock.recv_multipart()
        header, _ = decode(signer, frames)
        sock.send_multipart([identity, *encode(signer, {"id": header["id"], "ok": True, "n": header["n"]})])

    server, port = echo_server()
    conn = Connection(ctx, f"tcp://127.0.0.1:{port}", signer, "echo", 1 << 20)
    try:
        first = conn.send({"op": "x", "n": 1})
        answer(server)
        assert conn.recv(first, 20)[0]["n"] == 1
        pending = conn.send({"op": "x", "n": 2})
        server.close(linger=0)  # the server goes away with a request pending
        with pytest.raises(ServerUnavailableError, match="closed the connection"):
            conn.recv(pending, 20)
        server, _ = echo_server(port)  # ... and comes back on the same port
        for n in (3, 4):
            req = conn.send({"op": "x", "n": n})
            answer(server)
            assert conn.recv(req, 20)[0]["n"] == n
        assert not conn.lost
    finally:
        conn.close()
        server.close(linger=0)
        ctx.term()


def test_busy_controller_does_not_declare_healthy_units_dead(make_tq):
    """Heartbeats are read on their own thread: a request thread stuck for twice the heartbeat timeout
    behind a long request and a queue of 300 more (it handles 256 between timer runs) once declared
    both healthy units dead, for good."""
    import time

    tq = make_tq(heartbeat_timeout_s=1.5)
    with tq.client() as client:
        incarnations = {k: u["incarnation"] for k, u in client.status()["units"].items()}
    # A stand-in for an expensive request: it holds the controller's request thread for 3 s.
    tq.controller.server.handlers["busy"] = lambda req: time.sleep(3.0) or {}
    signer = Signer(tq.config.secret)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tq.address)
    try:
        sock.send_multipart(encode(signer, {"op": "busy", "id": 1}))
        for i in range(300):
            sock.send_multipart(encode(signer, {"op": "status", "id": 2 + i}))
        for _ in range(301):
            assert sock.poll(60000)
            sock.recv_multipart()
    finally:
        sock.close(linger=0)
        ctx.term()
    with tq.client() as client:
        units = client.status()["units"]
        assert all(u["alive"] for u in units.values())
        assert {k: u["incarnation"] for k, u in units.items()} == incarnations  # never re-registered
