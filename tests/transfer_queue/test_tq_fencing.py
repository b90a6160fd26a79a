"""Write fencing: a range freed by a rollback or a clear is reused only after its unit refuses the old
epoch; late writes and stale commits fail with a clear error and never touch the next put's bytes."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from asyncflow.transfer_queue import BadRequestError, StalePutError
from asyncflow.transfer_queue.protocol import Signer
from asyncflow.transfer_queue.transport import Connection

X = ["dense", "float32", [16]]


class Raw:
    """Bare protocol connections, to play a writer that is slow, dead or replayed."""

    def __init__(self, tq):
        self.ctx = zmq.Context()
        self.signer = Signer(tq.config.secret)
        self.ctl = Connection(self.ctx, tq.address, self.signer, "controller", 1 << 30)
        self.units = {}

    def call(self, header, buffers=()):
        return self.ctl.request(header, buffers, timeout_s=10)[0]

    def unit(self, tq, uid):
        if uid not in self.units:
            address = next(u[1] for u in self.call({"op": "hello"})["units"] if u[0] == uid)
            self.units[uid] = Connection(self.ctx, address, self.signer, f"unit {uid}", 1 << 30)
        return self.units[uid]

    def prepare(self, partition, rows=4):
        return self.call({"op": "prepare_put", "partition": partition, "count": rows,
                          "fields": {"x": [X, None, None]}})

    def close(self):
        for conn in (self.ctl, *self.units.values()):
            conn.close()
        self.ctx.term()


@pytest.fixture
def raw(tq):
    r = Raw(tq)
    yield r
    r.close()


def wait_fenced(client, timeout=20.0):
    """Until every retiring range is fenced and free again (no timing is asserted)."""
    deadline = time.monotonic() + timeout
    while any(u["retiring_bytes"] for u in client.status()["units"].values()):
        assert time.monotonic() < deadline, client.status()["units"]
        time.sleep(0.01)


def location(client, partition, task):
    meta = client.get_meta(partition, task, ["x"], 4)
    _, units, offsets, _, _ = meta.locations["x"]
    client.release(partition, task)
    return units[0], offsets[0]


def test_late_write_after_a_rollback_is_refused_and_the_next_put_is_intact(tq, client, raw):
    client.create_partition("p")
    stale = raw.prepare("p")
    uid, _, _, offsets = stale["chunks"][0]
    raw.call({"op": "abort_put", "put": stale["put"]})
    wait_fenced(client)
    good = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    client.put("p", {"x": good})
    assert location(client, "p", "look") == (uid, offsets["x"])  # the fenced range was reused
    garbage = bytes(4 * 16 * 4)
    with pytest.raises(StalePutError, match=f"put {stale['put']} refused"):
        raw.unit(tq, uid).request({"op": "write", "ranges": [[offsets["x"], len(garbage)]],
                                   "epoch": stale["put"]}, [garbage], timeout_s=10)
    assert torch.equal(client.get("p", "t", ["x"], 4)["x"], good)
    # A replayed write of the committed put is refused as well: its epoch is closed once its ranges retire.
    client.clear("p", force=True)
    wait_fenced(client)
    with pytest.raises(StalePutError):
        raw.unit(tq, uid).request({"op": "write", "ranges": [[offsets["x"], len(garbage)]],
                                   "epoch": stale["put"] + 1}, [garbage], timeout_s=10)


def test_fences_come_only_from_the_controller(tq, raw):
    with pytest.raises(BadRequestError, match="controller's link only"):
        raw.unit(tq, 0).request({"op": "fence", "floor": 1 << 60, "epochs": []}, timeout_s=10)


def test_commit_of_a_force_cleared_put_is_refused_and_its_range_waits_out_the_lease(tq, client, raw):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(4, 16)})
    pending = raw.prepare("p")
    assert client.clear("p", force=True) == 8
    with pytest.raises(StalePutError, match="rolled back before its commit.*cleared"):
        raw.call({"op": "commit_put", "put": pending["put"]})
    # Its writer may still be copying on this host: the range is not reusable before its lease ends.
    units = client.status()["units"]
    assert sum(u["retiring_bytes"] for u in units.values()) >= 4 * 16 * 4
    client.create_partition("q")
    client.put("q", {"x": torch.ones(4, 16)})
    uid, _, _, offsets = pending["chunks"][0]
    assert location(client, "q", "look") != (uid, offsets["x"])


def test_commit_after_the_lease_expired_is_refused(make_tq):
    tq = make_tq(put_lease_s=0.2)
    raw = Raw(tq)
    try:
        with tq.client() as client:
            client.create_partition("p")
            put = raw.prepare("p")
            deadline = time.monotonic() + 20
            while client.status()["pending_puts"]:  # the controller's timer rolls it back
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(StalePutError, match="lease of 0.2 s expired"):
                raw.call({"op": "commit_put", "put": put["put"]})
            assert client.status("p")["partitions"]["p"]["live_rows"] == 0
    finally:
        raw.close()


def test_writer_checks_its_lease_before_copying(make_tq):
    tq = make_tq(put_lease_s=0.3)  # shorter than the client's safety margin: every lease is over at once
    with tq.client() as client:
        client.create_partition("p")
        with pytest.raises(StalePutError, match="lease of put"):
            client.put("p", {"x": torch.ones(4, 16)})
        status = client.status("p")
        assert status["partitions"]["p"]["live_rows"] == 0 and status["pending_puts"] == 0


def test_retried_commit_returns_the_first_answer(client, raw):
    client.create_partition("p")
    put = raw.prepare("p", rows=3)
    first = raw.call({"op": "commit_put", "put": put["put"]})
    again = raw.call({"op": "commit_put", "put": put["put"]})
    assert first["indexes"] == again["indexes"] == [0, 1, 2]
    assert client.status("p")["partitions"]["p"]["rows"] == 3
