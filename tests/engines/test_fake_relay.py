"""The fake engines' weight path over the relay between hosts (``bridge/relay.py`` with gloo on loopback): a fake
trainer's staging segment is mirrored by the real relay sender and receiver, and the fake rollout engine reads the
mirror as it reads the trainer's own segment. What lets a fake rollout instance run on another host than its
trainer (``tests/cluster/test_host_loss.py``)."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from asyncflow.bridge.staging import StaleStagingError
from asyncflow.engines.fake import SOURCE, FakePlan, FakeStagingWriter, read_staged


def test_a_fake_trainers_table_reaches_a_mirror_on_another_host_through_the_relay():
    from asyncflow.bridge.relay import RelayReceiver, RelaySender, RelayStore

    table = torch.randn(3, 11, 11)
    tag = uuid.uuid4().hex[:8]
    writer = FakeStagingWriter(table, f"afq-{os.getpid()}-wfake{tag}-{SOURCE}")
    plan = FakePlan.from_dict(FakePlan(table.shape).as_dict())
    store = RelayStore("127.0.0.1", timeout_s=120)
    spec = {**store.spec(["host-b"]), "chunk_mb": 100 * 4 / 2**20}  # 100 elements: the table takes 4 chunks
    mirrored, lock = {}, threading.Lock()

    def record(version, key, segment):
        with lock:
            mirrored[version] = (key, segment)

    receiver = RelayReceiver(plan, plan.rank, spec, 0, 1, f"afq-{os.getpid()}-wrfake{tag}-{SOURCE}", record)
    sender = RelaySender(writer, spec, 1)
    try:
        for version, sign in ((1, 1.0), (2, -1.0)):
            table.mul_(sign)
            writer.stage(version)
            sender.notify(version)
            deadline = time.time() + 60
            while version not in mirrored and time.time() < deadline:
                time.sleep(0.01)
            key, segment = mirrored[version]
            assert key == SOURCE and segment == receiver.segment
            torch.testing.assert_close(read_staged(segment, list(table.shape), version), table, rtol=0, atol=0)
            # the trainer's own segment reads the same (one host), and a slot never holds another version
            torch.testing.assert_close(read_staged(writer.segment, list(table.shape), version), table, rtol=0, atol=0)
        with pytest.raises(StaleStagingError):
            read_staged(receiver.segment, list(table.shape), 3)
        assert receiver.versions == 2 and receiver.received_bytes >= 2 * table.numel() * 4
        receiver.check()
    finally:
        sender.close()
        receiver.close()
        writer.close()
    assert not os.path.exists(f"/dev/shm/{receiver.segment}") and not os.path.exists(f"/dev/shm/{writer.segment}")


def _receive(spec: dict, shape: list[int], segment: str, versions) -> None:
    from asyncflow.bridge.relay import RelayReceiver

    plan = FakePlan(shape)
    RelayReceiver(plan, plan.rank, spec, 0, 1, segment, lambda version, key, seg: versions.put(version))
    time.sleep(600)  # until it is killed


def test_a_lost_receiving_host_stops_the_relay_not_the_trainer():
    """The receiving side's process is SIGKILLed (its host lost): the sender's broadcast fails, and every later
    ``notify`` returns (the trainer goes on staging versions) with the failure kept in ``failed``."""
    import multiprocessing
    import signal

    from asyncflow.bridge.relay import RelaySender, RelayStore

    table = torch.randn(3, 11, 11)
    tag = uuid.uuid4().hex[:8]
    writer = FakeStagingWriter(table, f"afq-{os.getpid()}-wfake{tag}-{SOURCE}")
    store = RelayStore("127.0.0.1", timeout_s=60)
    spec = store.spec(["host-b"])
    ctx = multiprocessing.get_context("spawn")
    versions = ctx.Queue()
    mirror = f"afq-{os.getpid()}-wrfake{tag}-{SOURCE}"  # named after this process: removed here below
    receiver = ctx.Process(target=_receive, args=(spec, list(table.shape), mirror, versions))
    receiver.start()
    sender = RelaySender(writer, spec, 1)
    try:
        writer.stage(1)
        sender.notify(1)
        assert versions.get(timeout=60) == 1
        os.kill(receiver.pid, signal.SIGKILL)
        receiver.join(timeout=30)
        deadline = time.time() + 60
        version = 1
        while sender.failed is None and time.time() < deadline:
            version += 1
            writer.stage(version)
            sender.notify(version)  # never raises: the trainer goes on
            time.sleep(0.1)
        assert sender.failed is not None and version > 2
        writer.stage(version + 1)
        sender.notify(version + 1)
        torch.testing.assert_close(read_staged(writer.segment, list(table.shape), version + 1), table, rtol=0, atol=0)
    finally:
        sender.close()
        writer.close()
        if receiver.is_alive():
            receiver.kill()
        try:
            os.unlink(f"/dev/shm/{mirror}")
        except FileNotFoundError:
            pass
