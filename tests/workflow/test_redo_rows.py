"""What a restartable instance on the continuous stream relies on (``redo_rows.RedoRows``), on a real
TransferQueue (threads deployment): rows read without an ack keep a step from being done, a step whose rows are all
handed out is left for the next one, rows handed back (a peer died) are taken again without generating twice the
ones an instance still holds, acks under the newest hand-out make the step done, and a read a dead instance left
waiting is dropped before its rows are handed back."""

import threading
import time
from types import SimpleNamespace

import torch

from asyncflow.workflow.partitions import partition_name
from asyncflow.workflow.redo_rows import RedoRows
from asyncflow.workflow.supervisor import RedoClient

PART = partition_name(0)


def _instance(tq, writer: str | None = None) -> RedoRows:
    service = SimpleNamespace(tq=RedoClient(tq.address, tq.config, writer=writer), name="rollout", timeout_s=30.0)
    return RedoRows(service, poll_s=0.0)


def _put(rows: RedoRows, indexes: list[int]) -> None:
    """``rows``' instance puts the responses of ``indexes`` (row i: [i]) and acks them."""
    rows.svc.tq.put(PART, {"response_ids": [torch.tensor([i]) for i in indexes]}, indexes=indexes)
    rows.written(0, indexes)


def _done(rows: RedoRows):
    """The step's final read, once the controller has taken the one-way acks."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        batch = rows.read(0, ["prompt_ids"], 4, block=False)
        if batch is not None:
            return batch
        time.sleep(0.05)
    return None


def test_rows_handed_back_are_taken_again_and_acked_under_their_newest_hand_out(tq):
    a, b = _instance(tq), _instance(tq)
    driver = tq.client()
    try:
        driver.create_partition(PART, consumers=["rollout"], expected_rows=4)
        driver.put(PART, {"prompt_ids": [torch.tensor([i]) for i in range(4)]})
        first = a.read(0, ["prompt_ids"], 3, block=False)
        assert a.take(0, first) == [0, 1, 2]
        assert not a.handed_out(0)  # one row is still to be handed out: the instance stays on the step
        other = b.read(0, ["prompt_ids"], 3, block=False)
        assert b.take(0, other) == [0]
        assert a.handed_out(0) and b.handed_out(0)  # every row is out: the next step may be admitted
        assert a.read(0, ["prompt_ids"], 4, block=False) is None  # not done while rows are out unacked

        # B dies: the supervisor gives back every row the task holds, A's too. A takes them all again, and
        # generates only the one it did not hold.
        assert driver.release(PART, "rollout") == 4
        again = a.read(0, ["prompt_ids"], 4, block=False)
        assert sorted(again.indexes) == [0, 1, 2, 3]
        fresh = a.take(0, again)
        assert [again.indexes[i] for i in fresh] == other.indexes
        _put(a, [*first.indexes, *other.indexes])  # acked under the newest hand-out
        done = _done(a)
        assert done is not None and done.done
    finally:
        for client in (a.svc.tq, b.svc.tq, driver):
            client.close()


def test_a_row_put_then_handed_back_is_acked_at_once_and_written_once(tq):
    a, b = _instance(tq), _instance(tq)
    driver = tq.client()
    try:
        driver.create_partition(PART, consumers=["rollout"], expected_rows=1)
        driver.put(PART, {"prompt_ids": [torch.tensor([7])]})
        held = a.read(0, ["prompt_ids"], 1, block=False)
        a.take(0, held)
        assert driver.release(PART, "rollout") == 1  # a peer died while A generated the row
        taken = b.read(0, ["prompt_ids"], 1, block=False)
        assert b.take(0, taken) == [0]  # B generates it too
        _put(a, held.indexes)  # A's ack names a hand-out given back: ignored, the row stays out (with B)
        time.sleep(0.3)
        assert a.read(0, ["prompt_ids"], 1, block=False) is None
        skipped = RedoClient.skipped
        _put(b, taken.indexes)  # B's put is skipped (A's response stands), its ack ends the step
        assert RedoClient.skipped == skipped + 1 and b.svc.tq.last_skipped == taken.indexes  # B's is not counted
        done = _done(a)
        assert done is not None and done.done
        out = driver.get(PART, "check", ["response_ids"], 1)
        assert out["response_ids"][0].tolist() == [held.indexes[0]]
    finally:
        for client in (a.svc.tq, b.svc.tq, driver):
            client.close()


def test_a_dead_instances_waiting_read_is_dropped_and_its_rows_go_to_a_live_instance(tq):
    from asyncflow.config import AsyncFlowConfig
    from asyncflow.transfer_queue import ReadCancelledError
    from asyncflow.workflow.supervisor import Supervisor, writer_of

    a, b = _instance(tq, writer_of("rollout", 0)), _instance(tq, writer_of("rollout", 1))
    a.wait_s = b.wait_s = 60.0  # a read waits in the controller far longer than the test takes
    driver = tq.client()
    outcome = []

    def last_read():  # A's read for more rows, left waiting when it "dies"
        try:
            outcome.append(a.read(0, ["prompt_ids"], 2, block=True))
        except ReadCancelledError as exc:
            outcome.append(exc)

    try:
        driver.create_partition(PART, consumers=["rollout"], expected_rows=4)
        driver.put(PART, {"prompt_ids": [torch.tensor([i]) for i in range(2)]})
        held = a.read(0, ["prompt_ids"], 2, block=False)
        assert a.take(0, held) == [0, 1]
        waiting = threading.Thread(target=last_read)
        waiting.start()
        deadline = time.monotonic() + 30
        while driver.status()["parked_gets"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)

        # A died: the supervisor drops its waiting read, then hands its rows back, once.
        supervisor = Supervisor(AsyncFlowConfig(), SimpleNamespace(client=driver), reporter=None)
        assert supervisor._hand_back("rollout", 0) == (0, 2)
        waiting.join(timeout=30)
        assert len(outcome) == 1 and isinstance(outcome[0], ReadCancelledError)  # it was handed no rows
        driver.put(PART, {"prompt_ids": [torch.tensor([i]) for i in range(2, 4)]})
        # B takes the rows A held and those put after its death at once (with A's read still waiting they would go
        # to it, leased for row_lease_s, and this read would wait out its 60 s).
        taken = b.read(0, ["prompt_ids"], 4, block=True)
        assert sorted(taken.indexes) == [0, 1, 2, 3]
        assert driver.status()["parked_gets"] == 0
    finally:
        for client in (a.svc.tq, b.svc.tq, driver):
            client.close()
