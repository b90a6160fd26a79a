"""A writer that dies between a put's prepare and its commit: ``roll_back_puts`` frees the rows its pending puts
held at once (instead of after ``put_lease_s``), its successor puts them, and whatever the "dead" writer still sends
(a late commit, a late write into its old ranges) is refused and never reaches the successor's data."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from asyncflow.transfer_queue import BadRequestError, StalePutError, WritePendingError
from tests.transfer_queue.test_tq_fencing import Raw, wait_fenced

X = ["dense", "float32", [16]]
DEAD = "reward/0"


def prepare(raw: Raw, writer: str, rows: list[int], field: str = "y") -> dict:
    """A put of ``field`` into ``rows`` prepared by ``writer``, never written nor committed (its writer 'died')."""
    return raw.call({"op": "prepare_put", "partition": "p", "count": len(rows), "fields": {field: [X, None, None]},
                     "indexes": rows, "writer": writer})


def test_a_dead_writers_rows_are_freed_at_once_and_its_late_commit_is_refused(make_tq):
    tq = make_tq(put_lease_s=5.0)  # short, so that its ranges are fenced within the test; far above the test's steps
    raw = Raw(tq)
    try:
        with tq.client() as source, tq.client(writer="reward/0+1") as successor:
            source.create_partition("p")
            source.put("p", {"x": torch.zeros(4, 16)})
            stale = prepare(raw, DEAD, [0, 1, 2, 3])
            other = prepare(raw, "advantage/0", [0, 1], field="z")  # a live writer's put: left alone
            with pytest.raises(WritePendingError):  # without the rollback the rows wait for the lease
                successor.put("p", {"y": torch.ones(4, 16)}, indexes=[0, 1, 2, 3])

            assert source.roll_back_puts(DEAD) == 1
            assert source.status()["pending_puts"] == 1
            good = torch.arange(64, dtype=torch.float32).reshape(4, 16)
            assert successor.put("p", {"y": good}, indexes=[0, 1, 2, 3]) == [0, 1, 2, 3]

            with pytest.raises(StalePutError, match="declared dead"):
                raw.call({"op": "commit_put", "put": stale["put"]})
            raw.call({"op": "commit_put", "put": other["put"]})  # the live writer's put commits as usual
            # A late write of the dead put goes to its old ranges, which nobody else was given: the successor's
            # bytes stay intact whether the unit still takes it or already refuses it.
            uid, _, _, offsets = stale["chunks"][0]
            garbage = torch.full((4, 16), -1.0).numpy().tobytes()
            write = {"op": "write", "ranges": [[offsets["y"], len(garbage)]], "epoch": stale["put"]}
            try:
                raw.unit(tq, uid).request(write, [garbage], timeout_s=10)
            except StalePutError:
                pass
            assert torch.equal(source.get("p", "check", ["y"], 4)["y"], good)
            # Once its lease and the copy grace are over its ranges are fenced: its writes are refused from then on.
            wait_fenced(source)
            with pytest.raises(StalePutError, match="refused"):
                raw.unit(tq, uid).request(write, [garbage], timeout_s=10)
            assert source.roll_back_puts(DEAD) == 0  # nothing left of it
    finally:
        raw.close()


def test_a_dead_writers_parked_put_is_dropped_and_the_next_one_goes_in(make_tq):
    tq = make_tq(max_rows=4)
    raw = Raw(tq)
    try:
        with tq.client() as client:
            client.create_partition("p")
            rows = client.put("p", {"x": torch.zeros(4, 16)})
            # The dead writer's append waits for capacity; had it stayed parked, the rows freed next would go to it
            # and be held by a put nobody will commit.
            parked = raw.ctl.send({"op": "prepare_put", "partition": "p", "count": 2, "fields": {"x": [X, None, None]},
                                   "writer": DEAD, "timeout": 60.0})
            deadline = time.monotonic() + 20  # it comes on another connection: wait until the controller parked it
            while not client.status()["parked_puts"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert client.roll_back_puts(DEAD) == 1
            with pytest.raises(StalePutError, match="dropped before it was prepared"):
                raw.ctl.recv(parked, 10, "prepare_put")
            assert client.status()["parked_puts"] == 0
            client.clear("p", rows[:2], force=True)
            assert len(client.put("p", {"x": torch.ones(2, 16)})) == 2
            assert client.status()["pending_puts"] == 0
    finally:
        raw.close()


@pytest.mark.parametrize("writer", ["", 7, "w" * 300])
def test_a_malformed_writer_is_refused(client, writer):
    client.create_partition("p")
    with pytest.raises(BadRequestError, match="writer must be"):
        client._call({"op": "roll_back_puts", "writer": writer})
    with pytest.raises(BadRequestError, match="writer must be"):
        client._call({"op": "prepare_put", "partition": "p", "count": 1, "fields": {"x": [X, None, None]},
                      "writer": writer})


def test_every_put_carries_its_clients_writer_tag(tq):
    with tq.client() as a, tq.client() as b, tq.client(writer="rollout/1") as named:
        assert a.writer != b.writer and named.writer == "rollout/1"
        with pytest.raises(BadRequestError, match="writer must be"):
            tq.client(writer="")


def test_the_async_client_names_its_writer_and_rolls_back_a_dead_one(tq):
    raw = Raw(tq)

    async def main():
        async with tq.async_client(writer="rollout/0") as client:
            await client.create_partition("p")
            rows = await client.put("p", {"x": torch.zeros(2, 16)})
            prepare(raw, DEAD, rows)
            assert (await client.status())["pending_puts"] == 1
            assert await client.roll_back_puts(DEAD) == 1
            assert await client.put("p", {"y": torch.ones(2, 16)}, indexes=rows) == rows
            return client.writer

    try:
        assert asyncio.run(main()) == "rollout/0"
    finally:
        raw.close()
