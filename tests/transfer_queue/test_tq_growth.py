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
