"""The fake engines' weight path over the relay between hosts (``bridge/relay.py`` with gloo on loopback): a fake
trainer's staging segment is mirrored by the real relay sender and receiver, and the fake rollout engine reads the
mirror as it reads the trainer's own segment. What lets a fake rollout instance run on another host than its
trainer (``tests/cluster/test_host_loss.py``). The relay group re-forms without a receiving host whose process was
SIGKILLed, and with a receiver started again for it."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from asyncflow.bridge.staging import StaleStagingError
from asyncflow.engines.fake import SOURCE, FakePlan, FakeStagingWriter, read_staged
from tests.forkserver import start_method


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


def _receive(spec: dict, shape: list[int], segment: str, versions, receiver: int, receivers: int) -> None:
    from asyncflow.bridge.relay import RelayReceiver

    plan = FakePlan(shape)
    RelayReceiver(plan, plan.rank, spec, receiver, receivers, segment,
                  lambda version, key, seg: versions.put((receiver, segment, version)))
    time.sleep(600)  # until it is killed


def test_the_relay_reforms_without_a_lost_receiving_host_and_takes_it_back_when_it_restarts(monkeypatch):
    """Two receiving hosts, each a process of its own. One is SIGKILLed (its host lost) after it asked into the next
    generation: the sender's broadcast fails and the next generation, which names the lost host, cannot form; that
    formation fails within ``form_timeout_s`` (not the group's 300 s timeout) and the generation after it forms with
    the other host, which goes on getting every later version; the trainer's ``notify`` never waits or raises. A
    receiver started again for the lost host's index joins the next generation and gets the newest version, exactly
    as staged."""
    import multiprocessing
    import queue
    import signal

    from asyncflow.bridge import relay
    from asyncflow.bridge.relay import RelaySender, RelayStore, _store

    # The sender (this process) waits 1 s, not 5, for the receivers still up to ask into a new generation: one that
    # asks later joins the generation after, so only the test's time depends on it.
    monkeypatch.setattr(relay, "REFORM_WINDOW_S", 1.0)
    table = torch.zeros(3, 11, 11)
    tag = uuid.uuid4().hex[:8]
    writer = FakeStagingWriter(table, f"afq-{os.getpid()}-wfake{tag}-{SOURCE}")
    # The group's timeout is far beyond stage_until's 90 s: the lost host's formation must fail on its own timeout.
    store = RelayStore("127.0.0.1", timeout_s=300)
    spec = {**store.spec(["host-b", "host-c"]), "form_timeout_s": 2.0}
    ctx = multiprocessing.get_context(start_method())
    got = ctx.Queue()
    mirrors = [f"afq-{os.getpid()}-wrfake{tag}-{name}-{SOURCE}" for name in ("b", "c", "b2")]  # removed below
    procs = [ctx.Process(target=_receive, args=(spec, list(table.shape), mirrors[r], got, r, 2)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    sender = RelaySender(writer, spec, 2)
    version, seen = 0, {}  # mirror -> versions it reported

    def stage_until(done) -> None:
        nonlocal version
        deadline = time.time() + 90
        while not done() and time.time() < deadline:
            version += 1
            table.fill_(float(version))
            writer.stage(version)
            sender.notify(version)  # returns at once: the trainer never waits for the relay
            try:
                while True:
                    _, mirror, v = got.get(timeout=0.2)
                    seen.setdefault(mirror, []).append(v)
            except queue.Empty:
                pass
        assert done(), (version, seen, sender.generation, sender.ended)

    try:
        stage_until(lambda: all(seen.get(m) for m in mirrors[:2]))
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(timeout=30)
        # It had asked into the next generation before it died: the sender makes that generation with it.
        _store(spec, writer.rank).set(f"g{sender.generation + 1}/want/0", "1")
        lost_at = version
        stage_until(lambda: max(seen[mirrors[1]]) >= lost_at + 3)  # the other host goes on
        assert sender.generation >= 2 and sender.members == [1] and sender.failed is None, sender.ended
        assert any("timeout" in why for why in sender.ended[1:]), sender.ended  # the formation that failed
        procs.append(ctx.Process(target=_receive, args=(spec, list(table.shape), mirrors[2], got, 0, 2)))
        procs[-1].start()
        stage_until(lambda: seen.get(mirrors[2]))
        assert sender.members == [0, 1] and sender.failed is None
        # Nothing is staged after ``version``: both mirrors get it, the new one exactly as the trainer staged it.
        deadline = time.time() + 30
        while not all(version in seen.get(m, []) for m in mirrors[1:]) and time.time() < deadline:
            _, mirror, v = got.get(timeout=30)
            seen.setdefault(mirror, []).append(v)
        assert all(version in seen[m] for m in mirrors[1:]), (version, seen)
        torch.testing.assert_close(read_staged(mirrors[2], list(table.shape), version),
                                   torch.full_like(table, float(version)), rtol=0, atol=0)
        assert min(seen[mirrors[2]]) > lost_at
        # Versions only grow in each mirror, the lost host's mirror reported none after its death.
        assert all(a < b for vs in seen.values() for a, b in zip(vs, vs[1:])), seen
        assert max(seen[mirrors[0]]) <= lost_at
    finally:
        sender.close()
        writer.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        got.close()
        got.join_thread()
        for mirror in mirrors:
            try:
                os.unlink(f"/dev/shm/{mirror}")
            except FileNotFoundError:
                pass
