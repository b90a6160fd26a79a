"""Ray mode on a local Ray cluster: actors placed by a placement group, clients in other Ray workers
connect by address, and a storage-unit actor that dies loses its rows, visibly, without hangs."""

from __future__ import annotations

import time

import pytest
import torch

from asyncflow.transfer_queue import StorageUnitError

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
def remote_consumer(address: str, config) -> list:
    from asyncflow.transfer_queue import TransferQueueClient

    with TransferQueueClient(address, config) as client:
        batch = client.get("p", "remote", ["x", "tok"], 4, ragged="packed")
        return [batch.indexes, batch["x"].tolist(), batch["tok"].offsets.tolist()]


@pytest.mark.slow
def test_ray_mode(ray_cluster, make_tq):
    tq = make_tq(deployment="ray", ray_num_cpus_per_actor=0.25)
    assert tq.config.secret and len(tq.config.secret) >= 32  # generated at start, handed out by tq.config
    assert len(tq.actors) == 1 + tq.config.num_storage_units
    with tq.client() as client:
        client.create_partition("p")
        client.put("p", {"x": torch.arange(8.0)[:, None], "tok": [torch.arange(i) for i in range(8)]})
        indexes, x, offsets = ray.get(remote_consumer.remote(tq.address, tq.config), timeout=120)
        assert indexes == [0, 1, 2, 3] and x == [[0.0], [1.0], [2.0], [3.0]]
        assert offsets == [0, 0, 1, 3, 6]
        local = client.get("p", "remote", ["x"], 4)  # the same task continues where the other left
        assert local.indexes == [4, 5, 6, 7]
        # Kill the unit that holds the rows (a put this small goes to one unit), so they are really lost.
        units = client.status()["units"]
        holder = next(int(uid) for uid, unit in units.items() if unit["used_bytes"] > 0)
        tq.kill_unit(holder)
        deadline = time.monotonic() + 120
        while client.status()["units"][str(holder)]["alive"]:  # death detected by missed heartbeats
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.status("p")["partitions"]["p"]["lost_rows"] == 8
        with pytest.raises(StorageUnitError, match="lost"):
            client.put("p", {"reward": torch.ones(8)}, indexes=list(range(8)))
        client.seal("p")  # a consumer of the sealed partition is done at once, told how many rows were lost
        after = client.get("p", "after-death", ["x"], 8, timeout=120)
        assert after.done and after.meta.lost_rows == 8


def test_ray_mode_generates_a_secret_and_refuses_an_explicitly_open_binding():
    from asyncflow.transfer_queue import TransferQueueConfig

    # validate() is what RayDeployment runs before it places any actor.
    with pytest.raises(ValueError, match="secret"):
        TransferQueueConfig(deployment="ray", host="0.0.0.0").validate()
