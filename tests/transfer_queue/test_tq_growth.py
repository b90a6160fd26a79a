"""Bounded growth and wake-ups: requests naming new fields or tasks allocate nothing or are capped,
caches are bounded, whole-partition clears release memory, and clears wake the gets they finish."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncflow.transfer_queue import BadRequestError
from asyncflow.transfer_queue.partition import MAX_TASKS, MAX_VIEWS_PER_TASK


def test_a_get_naming_a_new_field_allocates_no_field_state(tq, client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(4, 2)})
    for i in range(20):
        assert client.poll("p", "t", ["x", f"never-written-{i}"], 1) is None
    part = tq.controller.partitions["p"]
    assert list(part.fields) == ["x"]
    assert len(part.tasks["t"].views) <= MAX_VIEWS_PER_TASK  # one view per field set, least recent dropped
    assert client.get("p", "t", ["x"], 4).indexes == [0, 1, 2, 3]  # a dropped view is rebuilt


def test_per_task_rows_are_allocated_at_the_first_hand_out(tq, client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(8, 2)})
    assert client.poll("p", "waiting", ["x", "y"], 1) is None  # named, nothing handed out yet
    part = tq.controller.partitions["p"]
    assert not part.tasks["waiting"].allocated and part.tasks["waiting"].consumed is None
    status = client.status("p")["partitions"]["p"]["tasks"]["waiting"]
    assert status["in_flight"] == 0 and status["read"] == 0
    assert client.release("p", "waiting") == 0  # nothing to give back, still nothing allocated
    assert not part.tasks["waiting"].allocated
    meta = client.get_meta("p", "reader", ["x"], 3)  # a hand-out allocates, at the partition's capacity
    state = part.tasks["reader"]
    assert state.allocated and len(state.consumed) == part.capacity
    client.get_data(meta)  # reads the rows and acks them
    status = client.status("p")["partitions"]["p"]["tasks"]
    assert status["reader"]["read"] == 3 and status["waiting"]["read"] == 0
    assert client.get("p", "waiting", ["x"], 8).indexes == list(range(8))  # every row was still FREE for it


def test_tasks_per_partition_are_capped(tq, client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(1, 2)})
    for i in range(MAX_TASKS):
        client.poll("p", f"t{i}", ["x"], 2)
    with pytest.raises(BadRequestError, match="consumer tasks"):
        client.poll("p", "one-too-many", ["x"], 2)


def test_whole_clear_releases_the_partition_and_its_caches(tq, client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(4, 2)})
    client.get_meta("p", "t", ["x"], 2, mp_rank=0, mp_size=2)  # leaves a replica batch cached
    assert tq.controller.replicas
    client.clear("p", force=True)
    assert "p" not in tq.controller.partitions and not tq.controller.replicas
    assert not [entry for entry in tq.controller.leases if entry[2] == "p"]


def test_a_cleared_partition_is_freed_at_once_not_by_the_garbage_collector(tq, client):
    import gc
    import weakref

    client.create_partition("p", expected_rows=256)
    client.put("p", {"x": torch.zeros(256, 2)}, group_ids=[i // 8 for i in range(256)])
    for task in ("a", "b"):
        for _ in client.iter_batches("p", task, ["x"], 64, sampler="group", sampler_args={"group_size": 8}):
            pass
    part = tq.controller.partitions["p"]
    refs = [weakref.ref(part)] + [weakref.ref(v) for t in part.tasks.values() for v in t.views.values()]
    assert len(refs) == 3
    del part
    gc.disable()  # the ready views point back at their partition: only breaking that cycle frees it now
    try:
        client.clear("p", force=True)
        alive = [r() for r in refs if r() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_retry_answers_are_kept_packed_and_within_a_byte_budget(tq, client, monkeypatch):
    from asyncflow.transfer_queue import transport

    server = tq.controller.server
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(64, 2)})
    client.get_meta("p", "t", ["x"], 64)
    kept = [v for v in server._answers.values() if v[0] == "done" and v[1] is not None]
    assert kept and all(isinstance(v[1], bytes) for v in kept)
    assert server._answer_bytes == sum(len(v[1]) for v in kept)
    monkeypatch.setattr(transport, "_ANSWER_BYTES", 4096)
    for _ in range(40):
        client.status("p")
    assert 0 < server._answer_bytes <= 4096


def test_replica_cache_expires_with_the_lease(tq, client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(4, 2)})
    first = client.get_meta("p", "t", ["x"], 2, mp_rank=0, mp_size=2, lease=0.2)  # rank 1 never asks
    deadline = time.monotonic() + 20
    while tq.controller.replicas:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The rows came back: both ranks of the replica now get them, from a fresh sample.
    again = [client.get_meta("p", "t", ["x"], 2, mp_rank=r, mp_size=2) for r in (0, 1)]
    assert again[0].indexes == again[1].indexes == first.indexes


def test_clearing_the_missing_rows_wakes_a_consumer_of_a_sealed_partition(client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(4, 2)})
    client.put("p", {"y": torch.ones(2)}, indexes=[0, 1])
    client.seal("p")
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("b", client.get("p", "t", ["x", "y"], 4,
                                                                            timeout=120)))
    thread.start()
    deadline = time.monotonic() + 20
    while client.status()["parked_gets"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client.clear("p", [2, 3], force=True)  # the rows it waited for will never get y
    thread.join(60)
    assert not thread.is_alive() and got["b"].indexes == [0, 1]
