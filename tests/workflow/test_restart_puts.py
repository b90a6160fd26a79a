"""What a restarted worker relies on, on a real TransferQueue (threads deployment): rows read without an ack stay
in flight until the supervisor releases them, and a ``RedoClient`` put skips the rows a dead predecessor already
wrote (fields are write-once: the first write stands) and writes the others."""

import time

import pytest
import torch

from asyncflow.transfer_queue import AlreadyWrittenError, TransferQueueClient
from asyncflow.workflow.supervisor import RedoClient


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


def test_a_put_the_dead_worker_prepared_is_rolled_back_and_its_successor_puts_at_once(tq):
    """The worker dies between a put's prepare and its commit: the supervisor rolls back the puts of its writer tag
    (``Supervisor._roll_back``), and its successor, under the same tag, puts those rows without waiting for the
    dead put's lease (``transfer_queue.put_lease_s``, 120 s here)."""
    from asyncflow.transfer_queue.client import encode_put, put_header
    from asyncflow.workflow.supervisor import writer_of

    driver = tq.client()
    dead = RedoClient(tq.address, tq.config, writer=writer_of("reward", 0))
    try:
        driver.create_partition("p", consumers=["reward"])
        driver.put("p", {"x": torch.arange(4.0)})
        encoded, count = encode_put({"y": torch.zeros(4)}, [0, 1, 2, 3], None, None, None)
        dead._call(put_header("p", encoded, count, [0, 1, 2, 3], None, None, None, 10.0, dead.writer))
        dead.close()  # prepared, never written nor committed: it "died"
        assert driver.status()["pending_puts"] == 1
        assert driver.roll_back_puts(writer_of("reward", 0)) == 1
        assert driver.status()["pending_puts"] == 0
        with RedoClient(tq.address, tq.config, writer=writer_of("reward", 0)) as successor:
            # A plain put: it would fail with WritePendingError had the dead put still held the rows.
            TransferQueueClient.put(successor, "p", {"y": torch.tensor([20.0, 21.0, 22.0, 23.0])},
                                    indexes=[0, 1, 2, 3])
        out = driver.get("p", "check", ["y"], 4)
        assert dict(zip(out.indexes, out["y"].tolist())) == {i: 20.0 + i for i in range(4)}
    finally:
        driver.close()


def test_rows_trained_and_cleared_before_the_successors_copy_is_done_count_as_written(tq):
    """The sample stream's orphan slot: a removed rollout instance's put committed, and it died before the board knew.
    The slot's rows were trained and cleared (every consumer read them) before the copy of its prompt was done: the
    copy's put skips them and writes its other rows."""
    from asyncflow.transfer_queue import RowsClearedError

    driver, successor = tq.client(), RedoClient(tq.address, tq.config)
    try:
        driver.create_partition("p", consumers=["reward"], auto_clear=True)
        driver.put("p", {"x": torch.arange(4.0)})
        driver.put("p", {"y": torch.tensor([10.0, 11.0])}, indexes=[0, 1])  # the dead instance's committed put
        trained = driver.get("p", "reward", ["x", "y"], 2)  # read and acked: auto-cleared
        assert sorted(trained.indexes) == [0, 1]
        deadline = time.monotonic() + 30  # the ack is one-way
        while driver.status("p")["partitions"]["p"]["live_rows"] > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.status("p")["partitions"]["p"]["live_rows"] == 2
        with pytest.raises(RowsClearedError):  # a plain put of those rows is refused
            driver.put("p", {"y": torch.zeros(2)}, indexes=[0, 1])
        skipped = RedoClient.skipped
        successor.put("p", {"y": torch.tensor([20.0, 21.0, 22.0, 23.0])}, indexes=[0, 1, 2, 3])
        assert successor.last_skipped == [0, 1] and RedoClient.skipped == skipped + 2
        out = driver.get("p", "reward", ["y"], 2)
        assert dict(zip(out.indexes, out["y"].tolist())) == {2: 22.0, 3: 23.0}
    finally:
        driver.close()
        successor.close()
