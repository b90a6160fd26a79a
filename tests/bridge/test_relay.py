"""The relay between hosts (``bridge/relay.py``) with gloo on loopback, and the per-pair route choice
(``bridge/routes.py``). The NCCL relay runs the same chunked code on CUDA buffers; it is untested here."""

from __future__ import annotations

import os
import threading
import time
import uuid

import torch

from asyncflow.bridge import routes
from asyncflow.bridge.shards import ParallelLayout, index
from asyncflow.bridge.staging import StagingReader
from tests.bridge.archs import ARCHS, random_hf_state
from tests.bridge.test_staging import _needed, _writers


def test_relay_mirrors_each_version_chunk_by_chunk_through_a_fixed_buffer():
    """Each source's slots are broadcast by a sender thread into one mirror per remote host, through one
    buffer of ``chunk_mb`` on each side (never a whole slot): readers of the mirrors see exactly what the
    trainer staged, also where the slot is not a multiple of the chunk."""
    from asyncflow.bridge.relay import RelayReceiver, RelaySender, RelayStore

    arch = ARCHS["qwen2_gqa"]
    hf_state = random_hf_state(arch)
    layout = ParallelLayout(2, 2, layers_per_stage=(1, 2))
    plan, shards, writers = _writers(arch, layout, hf_state, 1 << 12)
    store = RelayStore("127.0.0.1", timeout_s=120)
    chunk_mb = 1000 * 4 / 2**20  # 1000 float32 elements
    spec = {**store.spec(["host-b", "host-c"]), "chunk_mb": chunk_mb}  # below the floor a run gets, to test it
    mirrored: dict[int, dict[int, dict[str, str]]] = {0: {}, 1: {}}  # receiver -> version -> source -> segment
    lock = threading.Lock()

    def on_version(receiver):
        def record(version, key, segment):
            with lock:
                mirrored[receiver].setdefault(version, {})[key] = segment
        return record

    tag = uuid.uuid4().hex[:8]
    receivers = [RelayReceiver(plan, w.rank, spec, r, 2, f"afq-{os.getpid()}-wmirror{tag}-{r}-{key}", on_version(r))
                 for r in (0, 1) for key, w in writers.items()]
    senders = [RelaySender(w, spec, 2) for w in writers.values()]
    slot_numel = {key: w._slots.data[0].numel() for key, w in writers.items()}
    assert all(s.chunk == 1000 and s.buffer_bytes == 4000 for s in senders + receivers)
    assert max(slot_numel.values()) > 2 * 1000 and any(n % 1000 for n in slot_numel.values()), slot_numel
    assert store.spec(["b"], chunk_mb=1e-6)["chunk_mb"] == 1.0  # a tiny bucket_mb never means per-element broadcasts

    def wait_for(version):
        deadline = time.time() + 60
        while time.time() < deadline:
            for receiver in receivers:
                receiver.check()  # a receiver thread's own error fails the test with its cause
            with lock:
                if all(len(mirrored[r].get(version, {})) == len(writers) for r in (0, 1)):
                    return {r: dict(mirrored[r][version]) for r in (0, 1)}
            time.sleep(0.01)
        raise TimeoutError(f"version {version} never mirrored: {mirrored}")

    try:
        for version in (1, 2):
            if version == 2:
                for rank_shards in shards.values():
                    for t in rank_shards.values():
                        t.mul_(-1.0)
            for w, sender in zip(writers.values(), senders):
                w.stage(version)
                sender.notify(version)
            segments = wait_for(version)
            for r in (0, 1):
                reader = StagingReader(plan, segments[r], 2, r)
                seen = {}
                reader.read(version, seen.update)
                reader.close()
                sign = 1.0 if version == 1 else -1.0
                for name, boxes in _needed(arch, 2, r).items():
                    for box in boxes:
                        torch.testing.assert_close(seen[name][index(box)], sign * hf_state[name][index(box)],
                                                   rtol=0, atol=0)
        # Each receiver counts what came over the network: both versions' slot data and headers, once each.
        for receiver, key in zip(receivers, list(writers) * 2):
            assert receiver.versions == 2
            assert receiver.received_bytes == 2 * (slot_numel[key] * 4 + 2 * 2 * 8), (key, receiver.received_bytes)
        assert [s.sent_bytes for s in senders] == [2 * (slot_numel[k] * 4 + 2 * 2 * 8) for k in writers]
    finally:
        for sender in senders:
            sender.close()
        for receiver in receivers:
            receiver.close()
        for w in writers.values():
            w.close()


def test_relay_group_times_out_at_the_configured_step_timeout():
    from asyncflow.bridge.relay import RelayStore, _group
    from asyncflow.bridge.shards import MRank

    store = RelayStore("127.0.0.1", timeout_s=4321.0)
    group = _group(store.spec(["b"]), MRank(0, 0, 0), 0, 1)  # a group of the sender alone forms at once
    assert group.options._timeout.total_seconds() == 4321.0


def test_each_pair_is_routed_by_the_hosts_it_joins():
    # auto: the same node reads shared memory, another node relays
    a, b = "node-a", "node-b"

    def way(transport, trainer_node, rollout_node):
        return routes.pair_transport(routes.host_key(transport, trainer_node, "trainer"),
                                     routes.host_key(transport, rollout_node, "rollout"))

    assert way("auto", a, a) == "shm" and way("auto", a, b) == "relay"
    # explicit values force one way for every pair (tests)
    assert way("relay", a, a) == "relay" and way("shm", a, b) == "shm"
    assert not routes.needs_relay("auto", [a, a], [a, a]) and routes.needs_relay("auto", [a, a], [a, b])
    assert routes.needs_relay("relay", [a], [a]) and not routes.needs_relay("shm", [a], [b])
    # one receiver per remote host, whatever the number of instances on it; the host's first instance owns it
    rollout = [a, b, b, "node-c", b]
    assert routes.remote_hosts(a, rollout) == [b, "node-c"]
    assert routes.remote_hosts(b, rollout) == [a, "node-c"]
    assert [routes.receiver_owner(rollout, i) for i in range(5)] == [True, True, False, True, False]
    lines = routes.describe("auto", [a, b], [b])
    assert lines == ["trainer rank 0 -> rollout 0: relay (different nodes)",
                     "trainer rank 1 -> rollout 0: shm (same node)"]
