"""A storage unit that dies: waiting clients get an error, not a hang (no timing assertions: the
waits below are far longer than the heartbeat timeout, so an error proves detection, not expiry)."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncflow.transfer_queue import (
    ServerUnavailableError,
    StorageUnitError,
    TransferQueueClient,
    TransferQueueConfig,
)


def spread_rows(client, partition: str) -> None:
    # Small puts go to the least-used unit, so two puts land on the two units.
    client.put(partition, {"x": torch.zeros(4, 16)})
    client.put(partition, {"x": torch.zeros(4, 16)})
    units = client.status()["units"]
    assert all(u["used_bytes"] > 0 for u in units.values())


def test_waiting_consumer_fails_when_a_unit_dies(tq_procs):
    with tq_procs.client() as client:
        client.create_partition("p")
        spread_rows(client, "p")
        outcome = {}

        def wait_for_rewards():
            with tq_procs.client() as c:
                try:  # rewards never come: this waits until the unit's death is detected
                    c.get("p", "trainer", ["x", "rewards"], 8, timeout=120)
                except Exception as exc:  # noqa: BLE001 - the test inspects it
                    outcome["error"] = exc

        thread = threading.Thread(target=wait_for_rewards)
        thread.start()
        tq_procs.kill_unit(1)
        thread.join(60)
        assert not thread.is_alive()
        assert isinstance(outcome.get("error"), StorageUnitError)
        assert "died" in str(outcome["error"]) and "lost" in str(outcome["error"])
        # New requests for the damaged partition fail fast with the same explanation ...
        with pytest.raises(StorageUnitError, match="lost"):
            client.get("p", "other", ["x"], 1, timeout=120)
        # ... and the surviving unit keeps serving new partitions.
        client.create_partition("q")
        client.put("q", {"x": torch.ones(3, 4)})
        assert torch.equal(client.get("q", "t", ["x"], 3)["x"], torch.ones(3, 4))
        status = client.status()
        assert [u["alive"] for _, u in sorted(status["units"].items())] == [True, False]
        # Clearing the lost rows makes the partition usable again.
        client.clear("p", force=True)


def test_inline_reader_fails_when_its_unit_dies(tq_procs):
    config = TransferQueueConfig(**{**vars(tq_procs.config), "shm_enabled": False, "rpc_timeout_s": 120.0})
    with TransferQueueClient(tq_procs.address, config) as client:
        client.create_partition("p")
        spread_rows(client, "p")
        client.get("p", "t", ["x"], 8)  # connects to both units over ZMQ
        client.create_partition("r")
        client.put("r", {"x": torch.zeros(2, 16)})
        client.put("r", {"x": torch.zeros(2, 16)})
        meta = client.get_meta("r", "t", ["x"], 4)
        tq_procs.kill_unit(0)
        with pytest.raises(ServerUnavailableError, match="closed the connection"):
            client.get_data(meta)


def test_arenas_of_crashed_runs_are_removed_at_the_next_start(tmp_path):
    import os
    import subprocess
    import sys

    from asyncflow.transfer_queue.shm import SHM_DIR, remove_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: its arenas are leftovers
    stale = os.path.join(SHM_DIR, f"afq-{dead_pid}-0badc0de-unit0")
    live = os.path.join(SHM_DIR, f"afq-{os.getpid()}-0badc0de-unit0")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    try:
        assert remove_stale() >= 1
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
