"""``tools/two_host.py``: two Ray nodes that really are two hosts to everything above them, and a clean teardown."""

import subprocess

import pytest

from tests.cluster.conftest import load_two_host


def test_hosts_differ_in_address_hostname_and_shared_memory(two_hosts):
    import json
    import sys

    probe = """
import json, os, socket, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], log_to_driver=False)
@ray.remote(num_cpus=0)
def where():
    return {"host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "shm_dev": os.stat("/dev/shm").st_dev}
nodes = [n for n in ray.nodes() if n["Alive"]]
out = [ray.get(where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote())
       | {"npu": n["Resources"].get("NPU")} for n in nodes]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", probe, two_hosts.address], capture_output=True, text=True,
                          env=two_hosts.env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hosts = sorted(json.loads(proc.stdout.strip().splitlines()[-1]), key=lambda h: h["ip"])
    assert [h["ip"] for h in hosts] == sorted([two_hosts.addr_a, two_hosts.addr_b])
    assert [h["npu"] for h in hosts] == [2.0, 2.0]
    assert hosts[0]["host"] != hosts[1]["host"]
    assert hosts[0]["shm_dev"] != hosts[1]["shm_dev"]  # B's /dev/shm is its own filesystem
    # A segment made on host A is invisible on host B.
    marker = f"/dev/shm/two-host-probe-{two_hosts.suffix}"
    open(marker, "w").close()
    try:
        assert two_hosts.in_b("test", "-e", marker).returncode == 1
        assert two_hosts.in_b("hostname").stdout.strip() == two_hosts.hostname_b
    finally:
        import os

        os.unlink(marker)


@pytest.mark.slow
def test_down_removes_everything_it_made():
    two_host = load_two_host()
    try:
        cluster = two_host.up()
    except two_host.TwoHostError as exc:
        import os

        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the two-host cluster cannot be made here: {exc}")
    own = two_host._own_host_a_pids(cluster)
    assert own and two_host._netns_pids(cluster)
    two_host.down(cluster)
    state = two_host.status(cluster)
    assert not state["netns"] and not state["veth"] and state["netns_pids"] == 0
    assert not any(state["ray"].values())
    assert not any(two_host._alive(p) for p in own)
    assert not two_host._own_host_a_pids(cluster)
