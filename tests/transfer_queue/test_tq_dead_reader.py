"""A reader that dies while its blocking get waits in the controller: ``cancel_reads`` of its tag drops that get, so
that rows put or released after it go to live readers at once (without it they would go to the dead get, and stay
leased for ``row_lease_s``), and a get its client sent before it died that arrives later is refused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncflow.transfer_queue import ReadCancelledError
from asyncflow.transfer_queue.protocol import RequestIds
from tests.transfer_queue.test_tq_fencing import Raw

DEAD = "rollout/0"
GET = {"op": "get_meta", "partition": "p", "task": "rollout", "fields": ["x"], "batch_size": 2, "timeout": 60.0}

# A reader process: it parks a blocking get of task "rollout" under the tag DEAD (and is SIGKILLed while it waits).
READER = """
import sys
from asyncflow.transfer_queue import TransferQueueClient, TransferQueueConfig
client = TransferQueueClient(sys.argv[1], TransferQueueConfig(), writer=sys.argv[2])
print("parking", flush=True)
client.get("p", "rollout", ["x"], 2, timeout=60.0, ack=False)
print("got rows", flush=True)
"""


def wait_parked(client, n: int) -> None:
    """Until the controller holds ``n`` parked gets (they come on other connections)."""
    deadline = time.monotonic() + 60
    while client.status()["parked_gets"] != n:
        assert time.monotonic() < deadline, client.status()
        time.sleep(0.02)


def test_a_dead_readers_parked_get_is_dropped_and_the_rows_go_to_a_live_reader(tq):
    with tq.client() as source, tq.client(writer="rollout/1") as live:
        source.create_partition("p")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen([sys.executable, "-c", READER, tq.address, DEAD],
                                stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().strip() == "parking"
            wait_parked(source, 1)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.stdout.read() == ""  # it died waiting: it never got rows
        assert source.cancel_reads("rollout/7") == 0  # another reader's tag: the dead get stays
        assert source.status()["parked_gets"] == 1

        assert source.cancel_reads(DEAD) == 1
        assert source.status()["parked_gets"] == 0
        rows = source.put("p", {"x": torch.arange(4.0).reshape(2, 2)})
        # Put after the cancel: the live reader takes them at once (had the dead get stayed, they would be its, until
        # row_lease_s: this get would wait out its timeout).
        batch = live.get("p", "rollout", ["x"], 2, timeout=30.0, ack=False)
        assert batch.meta.indexes == rows
        task = source.status("p")["partitions"]["p"]["tasks"]["rollout"]
        assert task["in_flight"] == 2  # the live reader's hand-out, and no other
        live.ack(batch.meta)
        assert source.cancel_reads(DEAD) == 0  # nothing left of it


def test_released_rows_skip_a_cancelled_get_and_its_late_gets_are_refused(tq):
    raw = Raw(tq)
    try:
        with tq.client() as source, tq.client(writer="rollout/1") as live:
            source.create_partition("p")
            rows = source.put("p", {"x": torch.zeros(2, 2)})
            held = live.get_meta("p", "rollout", ["x"], 2, timeout=10.0)
            assert held.indexes == rows
            # The dead reader's client (request ids "deadclient.N") parked a get, and sent another that is still on
            # its way when its reads are cancelled.
            parked = raw.ctl.send({**GET, "reader": DEAD, "rid": "deadclient.1"})
            wait_parked(source, 1)
            assert source.cancel_reads(DEAD) == 1
            with pytest.raises(ReadCancelledError, match="declared dead"):
                raw.ctl.recv(parked, 10, "get_meta")
            with pytest.raises(ReadCancelledError, match="declared dead"):
                raw.call({**GET, "reader": DEAD, "rid": "deadclient.2"})
            # The rows a live reader held come back (a release, as the supervisor's) and go to a waiting live get.
            second = tq.client(writer="rollout/2")
            try:
                waiting = asyncio.run(_release_while_waiting(source, second))
            finally:
                second.close()
            assert waiting.indexes == rows
            # A new client under the dead tag (its restarted successor) reads as any.
            source.put("p", {"x": torch.ones(2, 2)})
            with tq.client(writer=DEAD) as successor:
                assert len(successor.get_meta("p", "rollout", ["x"], 2, timeout=10.0).indexes) == 2
            assert source.status()["parked_gets"] == 0
    finally:
        raw.close()


async def _release_while_waiting(source, reader):
    """``reader``'s blocking get, parked, then a release of the task's rows: the rows it gets."""
    get = asyncio.create_task(asyncio.to_thread(reader.get_meta, "p", "rollout", ["x"], 2, timeout=30.0))
    await asyncio.to_thread(wait_parked, source, 1)
    assert source.release("p", "rollout") == 2
    return await get


def test_the_async_client_sends_its_tag_with_gets_and_cancels_reads(tq):
    async def main():
        async with tq.async_client(writer="rollout/1") as client, tq.async_client(writer=DEAD) as dead:
            await client.create_partition("p")
            parked = asyncio.create_task(dead.get_meta("p", "rollout", ["x"], 2, timeout=60.0))
            while (await client.status())["parked_gets"] != 1:
                await asyncio.sleep(0.02)
            assert await client.cancel_reads(DEAD) == 1
            with pytest.raises(ReadCancelledError):
                await parked
            with pytest.raises(ReadCancelledError):  # this client object is the one declared dead
                await dead.get_meta("p", "rollout", ["x"], 2, timeout=1.0)
            await client.put("p", {"x": torch.zeros(2, 2)})
            return (await client.get_meta("p", "rollout", ["x"], 2, timeout=10.0)).indexes

    assert asyncio.run(main()) == [0, 1]


def test_a_retried_cancel_takes_no_effect_twice_and_spares_the_successors_get(tq):
    assert "rid" in RequestIds().stamp({"op": "cancel_reads", "reader": DEAD})  # clients give it a request id
    raw = Raw(tq)
    try:
        with tq.client() as source, tq.client(writer=DEAD) as successor:
            source.create_partition("p")
            raw.ctl.send({**GET, "reader": DEAD, "rid": "deadclient.1"})
            wait_parked(source, 1)
            cancel = {"op": "cancel_reads", "reader": DEAD, "rid": "supervisor.1"}
            assert raw.call(cancel)["cancelled"] == 1
            # The successor's get waits; the supervisor's request arrives again (a retry, a duplicate): it gets the
            # first answer and the successor's get stays.
            waiting = asyncio.run(_retry_while_waiting(source, successor, raw, cancel))
            assert waiting.indexes == [0, 1]
    finally:
        raw.close()


async def _retry_while_waiting(source, successor, raw, cancel):
    get = asyncio.create_task(asyncio.to_thread(successor.get_meta, "p", "rollout", ["x"], 2, timeout=30.0))
    await asyncio.to_thread(wait_parked, source, 1)
    assert (await asyncio.to_thread(raw.call, cancel))["cancelled"] == 1
    assert source.status()["parked_gets"] == 1
    source.put("p", {"x": torch.zeros(2, 2)})
    return await get
