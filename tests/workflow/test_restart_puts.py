"""What a restarted worker relies on, on a real TransferQueue (threads deployment): rows read without an ack stay
in flight until the supervisor releases them, and a ``RedoClient`` put skips the rows a dead predecessor already
wrote (fields are write-once: the first write stands) and writes the others."""

import time

import pytest
import torch

from asyncflow.transfer_queue import AlreadyWrittenError, TransferQueueConfig, start
from asyncflow.workflow.supervisor import RedoClient


@pytest.fixture
def tq():
    deployment = start(TransferQueueConfig(deployment="threads", storage_unit_capacity_bytes=16 << 20,
                                           get_timeout_s=10.0, put_timeout_s=10.0))
    yield deployment
    deployment.shutdown()


def _task(client, task: str) -> dict:
    return client.status("p")["partitions"]["p"]["tasks"][task]


def test_a_dead_workers_rows_are_made_again_and_written_once(tq):
    first, second = tq.client(), RedoClient(tq.address, tq.config)
    try:
        first.create_partition("p", consumers=["reward"])
        first.put("p", {"x": torch.arange(4.0)})
        # The first worker reads 4 rows, puts the output of 2 of them and dies before acking.
        held = first.get("p", "reward", ["x"], 4, ack=False)
        first.put("p", {"y": torch.tensor([10.0, 11.0])}, indexes=held.indexes[:2])
        assert _task(first, "reward")["in_flight"] == 4
        with pytest.raises(AlreadyWrittenError):  # a plain put of the same rows is refused
            first.put("p", {"y": torch.zeros(4)}, indexes=held.indexes)
        assert first.release("p", "reward") == 4  # the supervisor gives them back

        again = second.get("p", "reward", ["x"], 4, ack=False)
        assert sorted(again.indexes) == sorted(held.indexes)
        second.put("p", {"y": torch.tensor([20.0, 21.0, 22.0, 23.0])}, indexes=[0, 1, 2, 3])  # row i: 20 + i
        second.ack(again.meta)
        deadline = time.monotonic() + 30  # an ack is one-way: the controller takes it in its own time
        while _task(first, "reward")["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _task(first, "reward")["in_flight"] == 0 and _task(first, "reward")["read"] == 4
        out = first.get("p", "check", ["y"], 4)
        expected = {i: 20.0 + i for i in range(4)} | {held.indexes[0]: 10.0, held.indexes[1]: 11.0}
        assert dict(zip(out.indexes, out["y"].tolist())) == expected
    finally:
        first.close()
        second.close()
