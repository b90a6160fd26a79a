"""Safe defaults: a generated secret, no open binding without one, arena names that stay inside
/dev/shm, size caps before hashing, and secrets that never reach dumps, reprs or metrics sinks."""

from __future__ import annotations

import pytest
import torch
import zmq

from asyncflow.transfer_queue import (
    BadRequestError,
    ServerUnavailableError,
    TransferQueueClient,
    TransferQueueConfig,
    start,
)
from asyncflow.transfer_queue.controller import Controller
from asyncflow.transfer_queue.protocol import Signer, encode
from asyncflow.transfer_queue.shm import valid_arena_name
from asyncflow.transfer_queue.storage import StorageUnit
from asyncflow.transfer_queue.transport import Connection


def test_processes_deployment_generates_a_secret_and_ignores_clients_without_it(make_tq):
    tq = make_tq(deployment="processes")
    assert tq.config.secret and len(tq.config.secret) >= 32
    assert tq.config.secret not in repr(tq.config)
    with tq.client() as client:  # the deployment's config carries the secret
        client.create_partition("p")
        client.put("p", {"x": torch.ones(2, 2)})
    anonymous = TransferQueueConfig(**{**vars(tq.config), "secret": None, "rpc_timeout_s": 0.5})
    with pytest.raises(ServerUnavailableError, match="did not answer"):
        TransferQueueClient(tq.address, anonymous)


def test_user_secret_is_kept(make_tq):
    tq = make_tq(deployment="processes", secret="mine")
    assert tq.config.secret == "mine"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_open_binding_without_secret_is_refused_in_every_mode(host):
    for mode in ("threads", "processes", "ray"):
        with pytest.raises(ValueError, match="secret"):
            TransferQueueConfig(deployment=mode, host=host).validate()
    with pytest.raises(ValueError, match="secret"):
        start(TransferQueueConfig(deployment="threads", host=host))
    # The servers check it themselves too, whoever constructs them.
    with pytest.raises(ValueError, match="secret"):
        Controller(TransferQueueConfig(host=host))
    with pytest.raises(ValueError, match="secret"):
        StorageUnit(0, TransferQueueConfig(host=host), "tcp://127.0.0.1:1", None)


def test_arena_names_are_plain_file_names(tq):
    for bad in ("../etc/passwd", "/etc/passwd", "a/b", "..", ".hidden", "", "x" * 200, 5, "a\x00b"):
        assert not valid_arena_name(bad), bad
    assert valid_arena_name("afq-123-deadbeef-unit0")
    ctx = zmq.Context()
    conn = Connection(ctx, tq.address, Signer(tq.config.secret), "controller", 1 << 20)
    try:
        for bad in ("../../home/user/.bashrc", "/dev/shm/../etc/x", "sub/dir"):
            with pytest.raises(BadRequestError, match="plain file name"):
                conn.request({"op": "register_unit", "unit": 7, "address": "tcp://127.0.0.1:9",
                              "arena": bad, "size": 1 << 20}, timeout_s=10)
        status = conn.request({"op": "status"}, timeout_s=10)[0]
        assert "7" not in status["units"]
    finally:
        conn.close()
        ctx.term()


def test_oversized_messages_are_dropped_before_decoding(make_tq):
    tq = make_tq(secret="s", max_request_bytes=1 << 16)
    signer = Signer("s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tq.address)
    try:
        # Every frame under the per-frame cap that ZMQ enforces, the whole message far over it.
        frames = encode(signer, {"op": "status", "id": 1}, [b"\0" * 60000] * 20)
        sock.send_multipart(frames)
        sock.send_multipart(encode(signer, {"op": "status", "id": 2}))
        assert sock.poll(20000)
        reply = sock.recv_multipart()
        assert b"\x02" in reply[1]  # only the small request was answered (ids are handled in order)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert tq.controller.server.dropped_messages == 1


def test_secret_never_reaches_dumps_or_metrics_sinks(tmp_path):
    from asyncflow.config import load_config
    from asyncflow.config_loader import dump_yaml
    from asyncflow.observability.config import ObservabilityConfig
    from asyncflow.observability.metrics import SINKS, MetricsLogger, Sink, register_sink

    cfg = load_config(None, ["transfer_queue.secret=hunter2-secret"])
    assert cfg.transfer_queue.secret == "hunter2-secret"
    assert "hunter2-secret" not in dump_yaml(cfg)
    assert "hunter2-secret" not in repr(cfg)

    seen = {}

    @register_sink("capture-run-config")
    class Capture(Sink):
        def __init__(self, sink_cfg, run_config=None):
            super().__init__(sink_cfg, run_config)
            seen["run_config"] = run_config

        def write(self, step, metrics, wall_time, elapsed):
            pass

    try:
        import dataclasses

        obs = ObservabilityConfig(output_dir=str(tmp_path), jsonl=False, tensorboard=False)
        MetricsLogger(obs, extra_sinks=["capture-run-config"], run_config=dataclasses.asdict(cfg)).close()
    finally:
        SINKS.pop("capture-run-config", None)
    assert seen["run_config"]["transfer_queue"]["secret"] == "<redacted>"
    assert "hunter2-secret" not in repr(seen["run_config"])
