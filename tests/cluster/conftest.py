"""The two-host cluster (``tools/two_host.py``) as a fixture for the tests of this folder (one per module).

Host B is a network namespace with a private /dev/shm and its own hostname; both hosts run a Ray node declaring
``NPU`` devices. Making namespaces needs root: without it the tests fail with the reason when ``CI`` is set (CI runs as
root, so a skip there would hide that the cross-host tests never ran) and skip with the reason otherwise.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.zygote import HostBServer, session_server, two_host_options
from tests.zygote import enabled as zygote_enabled

REPO = Path(__file__).resolve().parents[2]


def load_two_host():
    """``tools/two_host.py`` as a module (``tools/`` is not a package)."""
    if "two_host" not in sys.modules:
        spec = importlib.util.spec_from_file_location("two_host", REPO / "tools/two_host.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["two_host"] = module
        spec.loader.exec_module(module)
    return sys.modules["two_host"]


def make_cluster(**kwargs):
    """``two_host.up(**kwargs)``, tried twice: on a loaded machine a Ray node now and then fails to join in time.
    Where namespaces cannot be made at all, or both tries fail, the test fails with the reason under ``CI`` and
    is skipped otherwise."""
    two_host = load_two_host()
    fail = pytest.fail if os.environ.get("CI") else pytest.skip
    try:
        two_host.check_possible()
    except two_host.TwoHostError as exc:
        fail(f"the two-host cluster cannot be made here: {exc}")
    errors = []
    for _ in range(2):
        try:
            return two_host.up(**kwargs)
        except two_host.TwoHostError as exc:
            errors.append(str(exc))
    fail("the two-host cluster did not come up in two tries: " + " | ".join(errors))


@pytest.fixture(scope="module")
def two_hosts():
    """A running two-host Ray cluster (``two_host.TwoHost``; host A declares 2 devices, host B 4, so that a layout
    can pin work to host B), removed after the module that uses it. Each host's Ray node forks its workers from a
    real-stack fork server on that host (``tests.zygote.two_host_options``; ``host_b_server`` is host B's).

    Pass ``cluster.env()`` to processes that join it (``asyncflow train ... ray.address=<cluster.address>``).
    """
    host_b = HostBServer() if zygote_enabled() else None
    cluster = make_cluster(devices=2, devices_b=4, **(two_host_options(host_b) if host_b else {}))
    cluster.host_b_server = host_b
    try:
        yield cluster
    finally:
        load_two_host().down(cluster)
        if host_b:
            host_b.remove_files()


def forks(cluster) -> tuple[int, int]:
    """Workers forked so far by the fork servers of hosts A and B of the ``two_hosts`` cluster (``tests.zygote``;
    none where the servers are off)."""
    if cluster.host_b_server is None:
        return 0, 0
    return session_server(real=True).forks(), cluster.host_b_server.forks()


def check_weight_bytes(layout: dict) -> str:
    """Assert how the weights reached every rollout host of a run's ``layout.json`` and return the bytes per
    transport per host as a Markdown table (``two_host.bytes_table``).

    Counted where they were read: a rollout instance read an exporting rank's own staging segment only on the
    rank's host (no byte of another host's shared memory), and the relay mirror of every rank on another host;
    a host's relay receiver took bytes off the network exactly when some exporting rank is elsewhere.
    """
    two_host = load_two_host()
    reads = two_host.weight_reads(layout)
    assert reads and all(r["source_ip"] and r["bytes"] > 0 for r in reads), reads
    assert sum(r["bytes"] for r in reads if r["via"] == "shm" and r["source_ip"] != r["rollout_ip"]) == 0, reads
    for r in reads:
        assert r["via"] == ("shm" if r["source_ip"] == r["rollout_ip"] else "relay"), r
    table = {(h, t): n for h, t, n in two_host.bytes_table(layout)}
    for host in {r["rollout_ip"] for r in reads}:
        local = any(r["source_ip"] == host for r in reads if r["rollout_ip"] == host)
        remote = any(r["source_ip"] != host for r in reads if r["rollout_ip"] == host)
        assert (table[host, "weights: shm staging read"] > 0) == local, (host, table)
        assert (table[host, "weights: relay mirror read"] > 0) == remote, (host, table)
        assert (table[host, "weights: relay network received"] > 0) == remote, (host, table)
    # The sending side: a host's exporting ranks broadcast bytes exactly when one of them relays to another host
    # (the totals are not compared: the last version may still be in flight when the layout is recorded).
    for host in {a["node_ip"] for a in layout["actor"]}:
        relays = any(a["weights"].get("sends_to") for a in layout["actor"] if a["node_ip"] == host)
        assert (table[host, "weights: relay network sent"] > 0) == relays, (host, table)
    return two_host.format_table(two_host.bytes_table(layout))


def check_tq_and_weights_across_hosts(cluster, stdout: str, out: Path, steps: int) -> dict:
    """Assert what every run of the loop across the two hosts must show, from its stdout and output folder:
    the TransferQueue binds every interface and every worker got host A's veth address (never 127.0.0.1 of
    host A), clients on host A move bytes only by shared memory and those on host B only by socket, weights
    reach a host without an exporting rank only through its relay mirror (``check_weight_bytes``), every
    step's weights came over from the trainer and vLLM's logprobs equal Megatron's at every version.
    Returns the run's ``layout.json``."""
    a, b = cluster.addr_a, cluster.addr_b
    assert "network: 2 Ray nodes: TransferQueue binds 0.0.0.0" in stdout
    assert f"relay store on the driver's node address {a};" in stdout  # not 127.0.0.1 of host A
    layout = json.loads((out / "layout.json").read_text())
    tq = layout["transfer_queue"]
    assert tq["bind"] == "0.0.0.0" and tq["advertise"] == a
    assert tq["controller"].startswith(f"tcp://{a}:") and all(u.startswith(f"tcp://{a}:") for u in tq["units"])
    assert {w["tq_address"] for w in tq["workers"]} == {tq["controller"]}
    # The storage units live on host A: clients there use shared memory, clients on host B only sockets.
    on_b = [w for w in tq["workers"] if w["node_ip"] == b]
    on_a = [w for w in tq["workers"] if w["node_ip"] == a]
    assert on_b and on_a
    assert all(w["moved_bytes"]["shm"] == 0 for w in on_b) and sum(w["moved_bytes"]["socket"] for w in on_b) > 0
    assert all(w["moved_bytes"]["socket"] == 0 for w in on_a) and sum(w["moved_bytes"]["shm"] for w in on_a) > 0
    assert any("relay (different nodes)" in line for line in layout["weight_routes"])
    table = check_weight_bytes(layout)
    exporting = {r["node_ip"] for r in layout["actor"] if r["weights"].get("source")}
    remote = [r["weights"] for r in layout["rollout"] if r["node_ip"] not in exporting]
    assert remote and all(w["read_bytes"]["shm"] == 0 and w["read_bytes"]["relay"] > 0 for w in remote)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps
    # On-policy runs (max_staleness 0): every version is checked.
    gaps = [r["check/fresh_logprob_gap_max"] for r in records if r.get("check/fresh_logprob_gap_tokens")]
    assert len(gaps) == steps and max(gaps) <= 1e-5, gaps
    assert all(r["rollout/weight_buckets"] > 0 for r in records[1:]), [r["rollout/weight_buckets"] for r in records]
    per_host = {ip: {kind: sum(w["moved_bytes"][kind] for w in tq["workers"] if w["node_ip"] == ip)
                     for kind in ("shm", "socket")} for ip in (a, b)}
    print(json.dumps({"steps": len(records), "gap_max": max(gaps), "tq_bytes_by_host": per_host,
                      "weights": layout["weight_routes"]}))
    print(f"bytes per transport per host:\n{table}")
    return layout
