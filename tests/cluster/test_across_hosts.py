"""The tiny recipe on two hosts (``two_hosts``): the TransferQueue, the relay and the start-up checks across them.

What these runs prove: every address a worker on host B was given is host A's veth address (nothing goes
through 127.0.0.1 between hosts: loopback of host B is not host A), no client reads another host's shared
memory (host B's /dev/shm is its own filesystem; the clients count bytes by shared memory and by socket), the
weights reach host B through the relay, and vLLM's logprobs equal Megatron's at every version. What only a real
cluster proves: other network fabrics (NCCL, RDMA), real devices, and filesystems that are really separate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_runs import REPO, SMALL

STEPS = 3


def train(cluster, tmp_path: Path, name: str, *extra: str, model: Path | None = None) -> subprocess.CompletedProcess:
    """``asyncflow train`` of the tiny recipe, driven from host A, on the two-host cluster."""
    sizes = [s for s in SMALL if not s.startswith("workflow.steps=")] + [f"workflow.steps={STEPS}"]
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={model or tmp_path / 'model'}", f"observability.output_dir={tmp_path / name}",
           f"ray.address={cluster.address}", f"ray.accelerator={cluster.resource}", "ray.cpus_per_device=1",
           "ray.placement_strategy=SPREAD", "workflow.step_timeout_s=300", *sizes, *extra]
    env = cluster.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)


LAYOUTS = {
    # async: one trainer rank and one rollout engine, on different hosts.
    "async": ["workflow.mode=async", "workflow.max_staleness=1"],
    # sync shares each device between a trainer rank and a rollout engine: two of each, one pair per host.
    "sync": ["workflow.mode=sync", "workflow.max_staleness=0", "trainer.data_parallel=2",
             "workflow.rollout_instances=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_tiny_recipe_trains_across_hosts(two_hosts, tmp_path, mode):
    proc = train(two_hosts, tmp_path, mode, *LAYOUTS[mode])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / mode
    a, b = two_hosts.addr_a, two_hosts.addr_b
    assert "network: 2 Ray nodes: TransferQueue binds 0.0.0.0" in proc.stdout
    layout = json.loads((out / "layout.json").read_text())
    tq = layout["transfer_queue"]
    # Servers bind every interface and advertise host A's veth address; every worker got that address.
    assert tq["bind"] == "0.0.0.0" and tq["advertise"] == a
    assert tq["controller"].startswith(f"tcp://{a}:") and all(u.startswith(f"tcp://{a}:") for u in tq["units"])
    assert {w["tq_address"] for w in tq["workers"]} == {tq["controller"]}
    # Trainer and rollout on different hosts (async), or one pair on each host (sync).
    actor = {r["node_ip"] for r in layout["actor"]}
    rollout = {r["node_ip"] for r in layout["rollout"]}
    if mode == "async":
        assert actor | rollout == {a, b} and not actor & rollout
    else:
        assert actor == rollout == {a, b}
    # The storage units live on host A: clients there use shared memory, clients on host B only sockets.
    on_b = [w for w in tq["workers"] if w["node_ip"] == b]
    on_a = [w for w in tq["workers"] if w["node_ip"] == a]
    assert on_b and on_a
    assert all(w["moved_bytes"]["shm"] == 0 for w in on_b) and sum(w["moved_bytes"]["socket"] for w in on_b) > 0
    assert all(w["moved_bytes"]["socket"] == 0 for w in on_a) and sum(w["moved_bytes"]["shm"] for w in on_a) > 0
    assert any("relay (different nodes)" in line for line in layout["weight_routes"])
    # Every version's weights reached the rollout engines exactly.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    gaps = [r["check/fresh_logprob_gap_max"] for r in records if "check/fresh_logprob_gap_max" in r]
    assert gaps and max(gaps) <= 1e-5, gaps
    if mode == "sync":
        assert len(gaps) == STEPS  # k=0: every version is checked
    # From the first step generated on a trained version on (step 1 in sync, step 2 with k=1), weights came over.
    first = 1 if mode == "sync" else 2
    assert all(r["rollout/weight_buckets"] > 0 for r in records[first:]), [r["rollout/weight_buckets"] for r in records]
    per_host = {ip: {kind: sum(w["moved_bytes"][kind] for w in tq["workers"] if w["node_ip"] == ip)
                     for kind in ("shm", "socket")} for ip in (a, b)}
    print(json.dumps({"mode": mode, "steps": len(records), "gap_max": max(gaps),
                      "reward": [round(r["reward/mean"], 3) for r in records], "tq_bytes_by_host": per_host,
                      "weights": layout["weight_routes"]}))


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
        import shutil

        shutil.rmtree(model.parent, ignore_errors=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("asyncflow: error: model.path ") and str(model / "config.json") in err, err
    assert f"node {two_hosts.addr_b} ({two_hosts.hostname_b})" in err, err
    assert "TransferQueue" not in proc.stdout  # stopped before anything started
