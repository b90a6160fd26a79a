"""The TransferQueue's Ray deployment over two hosts: each storage unit advertises its own node's address, and a
client maps only the arenas of its own host (the unit on host B is reached by socket, with the same bytes)."""

import json
import os
import subprocess
import sys

import pytest

from tests.recipe_runs import REPO

DRIVER = """
import json, sys
import ray, torch
from asyncflow import transfer_queue
from asyncflow.config import load_config
from asyncflow.workflow.network import resolve_connected

ray.init(address=sys.argv[1], log_to_driver=False)
cfg = load_config(None, ["transfer_queue.deployment=ray", "transfer_queue.num_storage_units=3",
                         "transfer_queue.ray_placement_strategy=SPREAD"])
net = resolve_connected(cfg)
tq = transfer_queue.start(net.tq)
client = tq.client()
same = True
for i in range(6):  # several puts: rows land on every unit
    client.create_partition(f"p{i}")
    rows = torch.arange(4096.0).reshape(64, 64) + i
    client.put(f"p{i}", {"x": rows})
    same &= bool(torch.equal(client.get(f"p{i}", "t", ["x"], 64)["x"], rows))
import time
time.sleep(2 * net.tq.heartbeat_timeout_s)  # host B's unit reaches the controller's heartbeat port too
alive = all(u["alive"] for u in client.status()["units"].values())
units = {str(u.id): {"address": u.address, "mapped": u.arena is not None} for u in client._units.values()}
print(json.dumps({"units": units, "same": same, "alive": alive, "moved": client.moved_bytes, "bind": net.tq.host}))
client.close()
tq.shutdown()
"""


@pytest.mark.slow
def test_ray_deployment_advertises_each_units_node(two_hosts):
    env = two_hosts.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", DRIVER, two_hosts.address], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] and out["alive"] and out["bind"] == "0.0.0.0"
    hosts = {(u["address"].split("//")[1].rsplit(":", 1)[0], u["mapped"]) for u in out["units"].values()}
    # 4 actors (controller + 3 units) spread over 2 nodes: units on both hosts, each advertising its own node.
    # The driver is on host A: it maps the arenas of the units there and reaches host B's by socket.
    assert hosts == {(two_hosts.addr_a, True), (two_hosts.addr_b, False)}, out
    assert out["moved"]["shm"] > 0 and out["moved"]["socket"] > 0
