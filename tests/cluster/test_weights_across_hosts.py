"""The async recipe across the two hosts of ``tools/two_host.py`` (host A: 2 devices, host B: 4), and its teardown.

The tiny recipe with trainer TP2 x DP2 over both hosts and two rollout instances pinned to host B
(``ray.rollout_label_selector``): every TP group lies on one host (from the ranks' node ids); each exporting
rank on host A relays into host B's one receiver and one mirror, which both instances of host B read; an
exporting rank on host B is read from its own segment there (``weight_sync.transport: auto``, per pair); the
live logprob gap stays within 1e-5 at every step (on-policy, so every step checks it). The same run is the
async layout's check of the TransferQueue and the weight paths across hosts (``check_tq_and_weights_across_hosts``).
The file's last test removes the cluster and checks that nothing of it is left.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import check_tq_and_weights_across_hosts, check_weight_bytes, load_two_host, make_cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hosts_2_4():
    cluster = make_cluster(devices=2, devices_b=4)
    try:
        yield cluster
    finally:
        load_two_host().down(cluster)


def _node_ids(cluster) -> dict[str, str]:
    probe = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(json.dumps({n['NodeManagerAddress']: n['NodeID'] for n in ray.nodes() if n['Alive']}))")
    proc = subprocess.run([sys.executable, "-c", probe, cluster.address], capture_output=True, text=True,
                          env=cluster.env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_tp_groups_stay_on_a_host_and_host_b_shares_one_receiver(hosts_2_4, tmp_path):
    nodes = _node_ids(hosts_2_4)
    node_a, node_b = nodes[hosts_2_4.addr_a], nodes[hosts_2_4.addr_b]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp_path / 'model'}", f"observability.output_dir={out}", "model.make_tiny_if_missing=true",
           f"ray.address={hosts_2_4.address}", "ray.accelerator=NPU", "ray.cpus_per_device=1",
           f"ray.rollout_label_selector={json.dumps({'ray.io/node-id': node_b})}",
           "trainer.tensor_parallel=2", "trainer.data_parallel=2", "trainer.micro_batch_size=4",
           "workflow.rollout_instances=2", "workflow.steps=3", "workflow.prompts_per_step=4",
           "workflow.samples_per_prompt=4", "workflow.rollout_chunk=8", "workflow.score_chunk=8",
           "workflow.max_staleness=0", "algorithm.kl_coef=0",  # on-policy: every step checks the live gap
           "workflow.step_timeout_s=1234"]
    env = hosts_2_4.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    layout = check_tq_and_weights_across_hosts(hosts_2_4, proc.stdout, out, steps=3)

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
def test_a_tp_group_larger_than_a_node_is_a_clear_error(hosts_2_4, tmp_path):
    """Trainer TP 4 where host A has 2 devices and host B 2 left beside the rollout engines: no layout keeps
    the TP group on one node, and the run stops with a config error naming the sizes, before any worker."""
    from asyncflow.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "model", hidden_size=128, num_heads=4, num_kv_heads=4)  # TP 4 can split it
    node_b = _node_ids(hosts_2_4)[hosts_2_4.addr_b]
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp_path / 'model'}", f"observability.output_dir={tmp_path / 'run'}",
           "model.make_tiny_if_missing=false", f"ray.address={hosts_2_4.address}", "ray.accelerator=NPU",
           "ray.cpus_per_device=1", f"ray.rollout_label_selector={json.dumps({'ray.io/node-id': node_b})}",
           "trainer.tensor_parallel=4", "workflow.rollout_instances=2", "algorithm.kl_coef=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600, env=hosts_2_4.env())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "asyncflow: config error: trainer TP 4 x EP 1 over 4 devices needs 4 consecutive ranks on one node" \
        in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "layout.json").exists()  # stopped before any worker started


@pytest.mark.slow  # the cluster takes ~17 s to make
def test_down_removes_everything_it_made(hosts_2_4):
    """Last in the file: ``down`` of the cluster the runs above used (the fixture's own ``down`` then finds
    nothing left to remove)."""
    two_host = load_two_host()
    own = two_host._own_host_a_pids(hosts_2_4)
    assert own and two_host._netns_pids(hosts_2_4)
    two_host.down(hosts_2_4)
    state = two_host.status(hosts_2_4)
    assert not state["netns"] and not state["veth"] and state["netns_pids"] == 0
    assert not any(state["ray"].values())
    assert not any(two_host._alive(p) for p in own)
    assert not two_host._own_host_a_pids(hosts_2_4)
