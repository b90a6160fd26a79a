"""The two-host cluster (``tools/two_host.py``) as a session fixture for the tests of this folder.

Host B is a network namespace with a private /dev/shm and its own hostname; both hosts run a Ray node declaring
2 ``NPU``. Making namespaces needs root: without it the tests fail with the reason when ``CI`` is set (CI runs as
root, so a skip there would hide that the cross-host tests never ran) and skip with the reason otherwise.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_two_host():
    """``tools/two_host.py`` as a module (``tools/`` is not a package)."""
    if "two_host" not in sys.modules:
        spec = importlib.util.spec_from_file_location("two_host", REPO / "tools/two_host.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["two_host"] = module
        spec.loader.exec_module(module)
    return sys.modules["two_host"]


@pytest.fixture(scope="session")
def two_hosts():
    """A running two-host Ray cluster (``two_host.TwoHost``), removed at the end of the session.

    Pass ``cluster.env()`` to processes that join it (``asyncflow train ... ray.address=<cluster.address>``).
    """
    two_host = load_two_host()
    try:
        cluster = two_host.up()
    except two_host.TwoHostError as exc:
        message = f"the two-host cluster cannot be made here: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield cluster
    finally:
        two_host.down(cluster)


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
