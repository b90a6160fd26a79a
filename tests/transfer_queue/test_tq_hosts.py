"""Which storage units a client reaches through shared memory: only those on its own host, by host identity.

A file of the arena's name in this process's /dev/shm is not proof of the same host: on another host (or in
another mount namespace) it is a different segment, or one of another run. The identity (hostname, boot id, the
device of /dev/shm) is reported by each unit and compared by each client. The real cross-host case runs on the
two-host cluster (tests/cluster/test_across_hosts.py).
"""

from __future__ import annotations

import torch

from asyncflow.transfer_queue import shm


def test_same_host_client_uses_shared_memory(make_tq):
    client = make_tq().client()
    client.create_partition("p")
    client.put("p", {"x": torch.arange(64.0).reshape(8, 8)})
    assert torch.equal(client.get("p", "t", ["x"], 8)["x"], torch.arange(64.0).reshape(8, 8))
    assert all(u.arena is not None for u in client._units.values())
    assert client.moved_bytes["shm"] == 2 * 64 * 4 and client.moved_bytes["socket"] == 0


def test_client_of_another_host_never_maps_an_arena(make_tq, monkeypatch):
    """The arenas' files exist here (one machine), but the client reports another host: sockets only."""
    tq = make_tq()
    monkeypatch.setattr(shm, "_HOST_ID", "another-host/boot/0")
    client = tq.client()
    client.create_partition("p")
    client.put("p", {"x": torch.arange(64.0).reshape(8, 8)})
    assert torch.equal(client.get("p", "t", ["x"], 8)["x"], torch.arange(64.0).reshape(8, 8))
    assert all(u.arena is None for u in client._units.values())
    assert client.moved_bytes["shm"] == 0 and client.moved_bytes["socket"] == 2 * 64 * 4


def test_host_id_names_the_shared_memory_filesystem():
    import os
    import socket

    host, boot, dev = shm.host_id().split("/")
    assert host == socket.gethostname() and len(boot) > 8 and int(dev) == os.stat(shm.SHM_DIR).st_dev
