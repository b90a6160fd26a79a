"""Idempotent requests and row leases: rows handed out come back unless read or renewed, stale acks
never mark a later hand-out as read, a repeated request takes effect once, and rolled-back appends
give back their row budget."""

from __future__ import annotations

import threading
import time

import torch
import zmq

from asyncflow.transfer_queue.protocol import Signer
from asyncflow.transfer_queue.transport import Connection


def task_status(client, task, partition="p"):
    return client.status(partition)["partitions"][partition]["tasks"][task]


def wait_until(predicate, timeout=20.0):
    """Polls until ``predicate()`` holds (fails after ``timeout``; nothing about timing is asserted)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def fill(client, rows=4):
    client.create_partition("p")
    data = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    client.put("p", {"x": data})
    return data


def test_unread_rows_return_to_the_task_when_their_lease_ends(client):
    data = fill(client)
    meta = client.get_meta("p", "t", ["x"], 4, lease=0.2)  # the consumer takes the rows and vanishes
    assert task_status(client, "t")["in_flight"] == 4
    wait_until(lambda: task_status(client, "t")["lease_expired"] == 4)
    assert task_status(client, "t")["in_flight"] == 0
    again = client.get("p", "t", ["x"], 4)
    assert again.indexes == meta.indexes and torch.equal(again["x"], data)
    assert task_status(client, "t")["read"] == 4


def test_a_parked_consumer_gets_rows_whose_lease_ended(client):
    fill(client)
    client.get_meta("p", "t", ["x"], 4, lease=0.2)
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("b", client.get("p", "t", ["x"], 4, timeout=60)))
    thread.start()
    thread.join(60)
    assert got["b"].indexes == [0, 1, 2, 3]


def test_renewed_rows_stay_with_their_consumer(client):
    data = fill(client)
    meta = client.get_meta("p", "t", ["x"], 4, lease=1.0)
    assert client.renew(meta, lease=600) == 4
    time.sleep(1.5)  # past the first lease: only the renewal keeps the rows
    assert task_status(client, "t")["lease_expired"] == 0
    assert torch.equal(client.get_data(meta)["x"], data)
    wait_until(lambda: task_status(client, "t")["read"] == 4)


def test_stale_ack_does_not_mark_a_later_hand_out_read(client):
    fill(client)
    first = client.get_meta("p", "t", ["x"], 4)
    assert client.release("p", "t") == 4
    second = client.get_meta("p", "t", ["x"], 4)
    assert second.indexes == first.indexes and second.handout != first.handout
    client.get_data(first)  # the first holder reads late: its ack is stale
    wait_until(lambda: task_status(client, "t")["stale_acks"] == 4)
    status = task_status(client, "t")
    assert status["read"] == 0 and status["in_flight"] == 4
    assert client.renew(first) == 0  # nor can it renew rows that went out again
    client.get_data(second)
    wait_until(lambda: task_status(client, "t")["read"] == 4)


def test_a_repeated_request_takes_effect_once(tq, client):
    fill(client, rows=8)
    ctx = zmq.Context()
    conn = Connection(ctx, tq.address, Signer(tq.config.secret), "controller", 1 << 20)
    try:
        get = {"op": "get_meta", "partition": "p", "task": "t", "fields": ["x"], "batch_size": 4,
               "timeout": 10, "rid": "dup-get"}
        first = conn.request(get, timeout_s=10)[0]
        again = conn.request(get, timeout_s=10)[0]  # a duplicated or retried message
        assert first["indexes"] == again["indexes"] == [0, 1, 2, 3]
        assert task_status(client, "t")["in_flight"] == 4  # not 8: the second copy handed out nothing
        clear = {"op": "clear", "partition": "p", "indexes": [6], "force": True, "rid": "dup-clear"}
        assert conn.request(clear, timeout_s=10)[0]["cleared"] == 1
        assert conn.request(clear, timeout_s=10)[0]["cleared"] == 1  # the first answer, not a new clear
        # A parked request and its retry: one hand-out, answered to the retry.
        park = {"op": "get_meta", "partition": "p", "task": "u", "fields": ["x", "y"], "batch_size": 2,
                "timeout": 30, "rid": "dup-park"}
        conn.send(park)
        retry = conn.send(park)
        wait_until(lambda: client.status()["parked_gets"] == 1)
        client.put("p", {"y": torch.ones(2)}, indexes=[0, 1])
        assert conn.recv(retry, 30)[0]["indexes"] == [0, 1]
        assert task_status(client, "u")["in_flight"] == 2
    finally:
        conn.close()
        ctx.term()


def test_rolled_back_append_gives_back_its_row_budget(tq, client):
    client.create_partition("p", expected_rows=4)
    ctx = zmq.Context()
    conn = Connection(ctx, tq.address, Signer(tq.config.secret), "controller", 1 << 20)
    try:
        put = conn.request({"op": "prepare_put", "partition": "p", "count": 4,
                            "fields": {"x": [["dense", "float32", [3]], None, None]}}, timeout_s=10)[0]
        assert client.status("p")["partitions"]["p"]["sealed"]  # all four expected rows are reserved
        conn.request({"op": "abort_put", "put": put["put"]}, timeout_s=10)
    finally:
        conn.close()
        ctx.term()
    status = client.status("p")["partitions"]["p"]
    assert not status["sealed"] and status["rolled_back_rows"] == 4
    client.put("p", {"x": torch.ones(4, 3)})  # the budget is back
    assert client.status("p")["partitions"]["p"]["sealed"]
    batches = list(client.iter_batches("p", "t", ["x"], 3))
    assert [len(b) for b in batches] == [3, 1]


def test_a_put_whose_commit_reply_is_lost_is_committed_once(tq, client, monkeypatch):
    """The commit reaches the controller and takes effect, but its reply is lost (the client sees the
    controller as unavailable). The client asks again with the same request id and gets the first answer;
    it neither aborts the committed put nor leaves a retry to duplicate its rows."""
    from asyncflow.transfer_queue.errors import ServerUnavailableError

    client.create_partition("p", expected_rows=4)
    real_call, commits = client._call, []

    def lossy_call(header, *args, **kwargs):
        reply = real_call(header, *args, **kwargs)  # the request took effect on the controller
        if header.get("op") == "commit_put":
            commits.append(header["rid"])
            if len(commits) == 1:
                raise ServerUnavailableError("the reply was lost")
        return reply

    monkeypatch.setattr(client, "_call", lossy_call)
    data = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert client.put("p", {"x": data}) == [0, 1, 2, 3]
    assert len(commits) == 2 and commits[0] == commits[1]  # one request, sent twice
    status = client.status("p")["partitions"]["p"]
    assert status["rows"] == 4 and status["live_rows"] == 4 and status["rolled_back_rows"] == 0
    assert status["sealed"] and client.status()["pending_puts"] == 0
    assert torch.equal(client.get("p", "t", ["x"], 4)["x"], data)
