"""The two-host cluster of ``tools/two_host.py`` (``two_hosts``: host A 2 devices, host B 4) and what runs across
it: the hosts really differ, the TransferQueue's Ray deployment, a sync run and an async run of the tiny recipe,
the start-up checks, and the cluster's teardown. One cluster serves every test of the file (making one costs
about 17 s of a 2-core machine).

What these runs prove: host B has its own address, hostname and /dev/shm; every address a worker on host B was
given is host A's veth address (nothing goes through 127.0.0.1 between hosts: loopback of host B is not host A),
no client reads another host's shared memory (the clients count bytes by shared memory and by socket), the weights
reach host B through the relay, and vLLM's logprobs equal Megatron's at every version.

The async run: trainer TP2 x DP2 over both hosts and two rollout instances pinned to host B
(``ray.rollout_label_selector``): every TP group lies on one host (from the ranks' node ids); each exporting
rank on host A relays into host B's one receiver and one mirror, which both instances of host B read; an
exporting rank on host B is read from its own segment there (``weight_sync.transport: auto``, per pair).
What only a real cluster proves: other network fabrics (NCCL, RDMA), real devices, and filesystems that are
really separate.
"""


from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import check_tq_and_weights_across_hosts, check_weight_bytes, forks, load_two_host
from tests.recipe_runs import REPO, SMALL
from tests.zygote import launch_command

STEPS = 3

PROBE = """
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

TQ_DRIVER = """
import json, sys, time
import ray, torch
from asyncflow import transfer_queue
from asyncflow.config import load_config
from asyncflow.workflow.network import resolve_connected

ray.init(address=sys.argv[1], log_to_driver=False)
cfg = load_config(None, ["transfer_queue.deployment=ray", "transfer_queue.num_storage_units=3",
                         "transfer_queue.ray_placement_strategy=SPREAD",
                         "transfer_queue.heartbeat_timeout_s=3"])  # the check below waits two timeouts
net = resolve_connected(cfg)
tq = transfer_queue.start(net.tq)
client = tq.client()
same = True
for i in range(6):  # several puts: rows land on every unit
    client.create_partition(f"p{i}")
    rows = torch.arange(4096.0).reshape(64, 64) + i
    client.put(f"p{i}", {"x": rows})
    same &= bool(torch.equal(client.get(f"p{i}", "t", ["x"], 64)["x"], rows))
time.sleep(2 * net.tq.heartbeat_timeout_s)  # host B's unit reaches the controller's heartbeat port too
alive = all(u["alive"] for u in client.status()["units"].values())
units = {str(u.id): {"address": u.address, "mapped": u.arena is not None} for u in client._units.values()}
print(json.dumps({"units": units, "same": same, "alive": alive, "moved": client.moved_bytes, "bind": net.tq.host}))
client.close()
tq.shutdown()
"""


def _env(cluster) -> dict:
    env = cluster.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def train(cluster, tmp_path: Path, name: str, *extra: str, model: Path | None = None) -> subprocess.CompletedProcess:
    """``asyncflow train`` of the tiny recipe, driven from host A (forked from the tests' real-stack server:
    ``tests.zygote.launch_command``), on the two-host cluster."""
    sizes = [s for s in SMALL if not s.startswith("workflow.steps=")] + [f"workflow.steps={STEPS}"]
    cmd = [*launch_command(), "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={model or tmp_path / 'model'}", f"observability.output_dir={tmp_path / name}",
           f"ray.address={cluster.address}", f"ray.accelerator={cluster.resource}", "ray.cpus_per_device=1",
           "ray.placement_strategy=SPREAD", "workflow.step_timeout_s=300", *sizes, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=_env(cluster))


@pytest.mark.slow  # the cluster takes ~17 s to make
def test_hosts_differ_in_address_hostname_and_shared_memory(two_hosts):
    proc = subprocess.run([sys.executable, "-c", PROBE, two_hosts.address], capture_output=True, text=True,
                          env=two_hosts.env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hosts = sorted(json.loads(proc.stdout.strip().splitlines()[-1]), key=lambda h: h["ip"])
    assert [h["ip"] for h in hosts] == sorted([two_hosts.addr_a, two_hosts.addr_b])
    assert sorted(h["npu"] for h in hosts) == [2.0, 4.0]
    assert hosts[0]["host"] != hosts[1]["host"]
    assert hosts[0]["shm_dev"] != hosts[1]["shm_dev"]  # B's /dev/shm is its own filesystem
    # A segment made on host A is invisible on host B.
    marker = f"/dev/shm/two-host-probe-{two_hosts.suffix}"
    open(marker, "w").close()
    try:
        assert two_hosts.in_b("test", "-e", marker).returncode == 1
        assert two_hosts.in_b("hostname").stdout.strip() == two_hosts.hostname_b
    finally:
        os.unlink(marker)


@pytest.mark.slow
def test_ray_deployment_advertises_each_units_node(two_hosts):
    """Each storage unit advertises its own node's address, and a client maps only the arenas of its own host
    (the unit on host B is reached by socket, with the same bytes)."""
    proc = subprocess.run([sys.executable, "-c", TQ_DRIVER, two_hosts.address], capture_output=True, text=True,
                          env=_env(two_hosts), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] and out["alive"] and out["bind"] == "0.0.0.0"
    hosts = {(u["address"].split("//")[1].rsplit(":", 1)[0], u["mapped"]) for u in out["units"].values()}
    # 4 actors (controller + 3 units) spread over 2 nodes: units on both hosts, each advertising its own node.
    # The driver is on host A: it maps the arenas of the units there and reaches host B's by socket.
    assert hosts == {(two_hosts.addr_a, True), (two_hosts.addr_b, False)}, out
    assert out["moved"]["shm"] > 0 and out["moved"]["socket"] > 0


@pytest.mark.slow
def test_sync_recipe_trains_across_hosts(two_hosts, tmp_path):
    """sync shares each device between a trainer rank and a rollout engine: two of each, one pair per host.
    On-policy (k=0), so the live gap is checked at every version. The model is named by a path relative to the
    driver's folder: workers on host B start elsewhere."""
    before = forks(two_hosts)
    proc = train(two_hosts, tmp_path, "sync", "workflow.mode=sync", "workflow.max_staleness=0",
                 "trainer.data_parallel=2", "workflow.rollout_instances=2", model=Path("model"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if two_hosts.host_b_server:  # each host's workers were forked there (else the speed-up went without a word)
        (a, b), (a0, b0) = forks(two_hosts), before
        assert a > a0 + 1 and b > b0, (before, forks(two_hosts))  # host A's server forked the driver too
    layout = check_tq_and_weights_across_hosts(two_hosts, proc.stdout, tmp_path / "sync", STEPS)
    a, b = two_hosts.addr_a, two_hosts.addr_b
    assert {r["node_ip"] for r in layout["actor"]} == {r["node_ip"] for r in layout["rollout"]} == {a, b}


@pytest.mark.slow
def test_a_path_missing_on_one_node_is_named(two_hosts, tmp_path):
    """The model under host A's /dev/shm: host B has its own /dev/shm, so the run stops before starting anything,
    naming host B and the path."""
    from asyncflow.tiny_model import make_tiny_model

    model = Path(f"/dev/shm/asyncflow-node-check-{two_hosts.suffix}") / "model"
    try:
        make_tiny_model(model, family="qwen2", seed=0)
        proc = train(two_hosts, tmp_path, "missing", "workflow.mode=async", model=model)
    finally:
        shutil.rmtree(model.parent, ignore_errors=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("asyncflow: error: model.path ") and str(model / "config.json") in err, err
    assert f"node {two_hosts.addr_b} ({two_hosts.hostname_b})" in err, err
    assert "TransferQueue" not in proc.stdout  # stopped before anything started


def _node_ids(cluster) -> dict[str, str]:
    probe = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(json.dumps({n['NodeManagerAddress']: n['NodeID'] for n in ray.nodes() if n['Alive']}))")
    proc = subprocess.run([sys.executable, "-c", probe, cluster.address], capture_output=True, text=True,
                          env=cluster.env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_tp_groups_stay_on_a_host_and_host_b_shares_one_receiver(two_hosts, tmp_path):
    nodes = _node_ids(two_hosts)
    node_a, node_b = nodes[two_hosts.addr_a], nodes[two_hosts.addr_b]
    out = tmp_path / "run"
    cmd = [*launch_command(), "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp_path / 'model'}", f"observability.output_dir={out}", "model.make_tiny_if_missing=true",
           f"ray.address={two_hosts.address}", "ray.accelerator=NPU", "ray.cpus_per_device=1",
           f"ray.rollout_label_selector={json.dumps({'ray.io/node-id': node_b})}",
           "trainer.tensor_parallel=2", "trainer.data_parallel=2", "trainer.micro_batch_size=4",
           "workflow.rollout_instances=2", "workflow.steps=3", "workflow.prompts_per_step=4",
           "workflow.samples_per_prompt=4", "workflow.rollout_chunk=8", "workflow.score_chunk=8",
           "workflow.max_staleness=0", "algorithm.kl_coef=0",  # on-policy: every step checks the live gap
           "workflow.step_timeout_s=1234"]
    env = two_hosts.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    layout = check_tq_and_weights_across_hosts(two_hosts, proc.stdout, out, steps=3)

    # Each TP group (ranks 2g, 2g+1) on one host; the group's two ranks really share that host.
    actor = layout["actor"]
    groups = [{actor[2 * g]["node"], actor[2 * g + 1]["node"]} for g in range(2)]
    assert all(len(g) == 1 for g in groups), groups
    assert {n for g in groups for n in g} == {node_a, node_b}  # the trainer spans both hosts
    assert [a["group_timeout_s"] for a in actor] == [1234.0] * 4  # the run's step timeout, not torch's 10 min

    # Both rollout instances on host B, sharing one receiver: the first owns the mirrors, the second none.
    rollout = layout["rollout"]
    assert [r["node"] for r in rollout] == [node_b, node_b]
    assert [r["weights"]["host"] for r in rollout] == [node_b, node_b]
    assert [r["weights"]["owner"] for r in rollout] == [True, False] and rollout[1]["weights"]["mirrors"] == []

    # Per pair: exporting ranks on A relay to B; those on B publish their own segment (no relay). Ranks fill
    # nodes in address order, so the exporting TP group (data-parallel rank 0: ranks 0 and 1) is on host A.
    exporting = [a for a in actor if a["weights"]]
    on_a = [a for a in exporting if a["node"] == node_a]
    assert len(exporting) == len(on_a) == 2, actor
    for a in exporting:
        assert a["weights"]["sends_to"] == ([node_b] if a["node"] == node_a else []), a
    assert len(rollout[0]["weights"]["mirrors"]) == len(on_a)
    assert all(0 < b <= 512 * 2**20 for b in rollout[0]["weights"]["buffer_bytes"])
    assert any("relay (different nodes)" in line for line in layout["weight_routes"]) == bool(on_a)
    # Bytes as read: host B's two instances took the ranks on A from the one mirror (the receiver's bytes came
    # over the network once for both), never from A's shared memory.
    table = check_weight_bytes(layout)
    reads = load_two_host().weight_reads(layout)
    assert {(r["rollout"], r["via"]) for r in reads} == {(0, "relay"), (1, "relay")}, reads
    assert rollout[0]["weights"]["relay_received_bytes"] > 0 and rollout[1]["weights"]["relay_received_bytes"] == 0
    print(f"bytes per transport per host (TP2 x DP2, rollout x2 on host B):\n{table}")


@pytest.mark.slow
def test_a_tp_group_larger_than_a_node_is_a_clear_error(two_hosts, tmp_path):
    """Trainer TP 4 where host A has 2 devices and host B 2 left beside the rollout engines: no layout keeps
    the TP group on one node, and the run stops with a config error naming the sizes, before any worker."""
    from asyncflow.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "model", hidden_size=128, num_heads=4, num_kv_heads=4)  # TP 4 can split it
    node_b = _node_ids(two_hosts)[two_hosts.addr_b]
    cmd = [*launch_command(), "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp_path / 'model'}", f"observability.output_dir={tmp_path / 'run'}",
           "model.make_tiny_if_missing=false", f"ray.address={two_hosts.address}", "ray.accelerator=NPU",
           "ray.cpus_per_device=1", f"ray.rollout_label_selector={json.dumps({'ray.io/node-id': node_b})}",
           "trainer.tensor_parallel=4", "workflow.rollout_instances=2", "algorithm.kl_coef=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600, env=two_hosts.env())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "asyncflow: config error: trainer TP 4 x EP 1 over 4 devices needs 4 consecutive ranks on one node" \
        in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "layout.json").exists()  # stopped before any worker started


@pytest.mark.slow  # the cluster takes ~17 s to make
def test_down_removes_everything_it_made(two_hosts):
    """Last in the file: ``down`` of the cluster the runs above used (the fixture's own ``down`` then finds
    nothing left to remove)."""
    two_host = load_two_host()
    own = two_host._own_host_a_pids(two_hosts)
    assert own and two_host._netns_pids(two_hosts)
    two_host.down(two_hosts)
    state = two_host.status(two_hosts)
    assert not state["netns"] and not state["veth"] and state["netns_pids"] == 0
    assert not any(state["ray"].values())
    assert not any(two_host._alive(p) for p in own)
    assert not two_host._own_host_a_pids(two_hosts)
