"""Where a run's servers listen, chosen from the Ray cluster (``asyncflow.workflow.network``), and what
``asyncflow config show`` says about it. The cross-host runs themselves are in tests/cluster/."""

from __future__ import annotations

import subprocess
import sys

from asyncflow.config import load_config
from asyncflow.workflow.network import resolve

RECIPE = "recipes/tiny_cpu/grpo_async.yaml"


def test_one_node_keeps_loopback():
    cfg = load_config(RECIPE, [])
    net = resolve(cfg, 1, "192.0.2.7")
    assert net.tq.host == "127.0.0.1" and net.tq.advertise_host is None and net.tq.secret is None
    assert net.store_host == "127.0.0.1"


def test_several_nodes_bind_all_interfaces_and_advertise_the_driver_node():
    cfg = load_config(RECIPE, [])
    net = resolve(cfg, 2, "198.51.100.1")
    assert net.tq.host == "0.0.0.0" and net.tq.advertise_host == "198.51.100.1"
    assert net.tq.secret and len(net.tq.secret) == 64
    net.tq.validate()  # a non-loopback binding is accepted only with a secret
    assert net.store_host == "198.51.100.1"
    assert "TransferQueue binds 0.0.0.0" in net.log_line() and "relay store" in net.log_line()
    assert net.tq.secret not in net.log_line()


def test_ray_deployment_advertises_each_units_own_node():
    cfg = load_config(RECIPE, ["transfer_queue.deployment=ray"])
    net = resolve(cfg, 3, "198.51.100.1")
    assert net.tq.host == "0.0.0.0" and net.tq.advertise_host is None  # each actor looks its node up


def test_addresses_set_by_hand_are_kept():
    cfg = load_config(RECIPE, ["transfer_queue.host=198.51.100.9", "transfer_queue.secret=s3cret",
                               "weight_sync.store_host=198.51.100.9"])
    net = resolve(cfg, 2, "198.51.100.1")
    assert (net.tq.host, net.tq.secret, net.store_host) == ("198.51.100.9", "s3cret", "198.51.100.9")


def test_config_show_says_what_is_resolved_at_start():
    out = subprocess.run([sys.executable, "-m", "asyncflow.cli", "config", "show", RECIPE], capture_output=True,
                         text=True, check=True).stdout
    tail = out[out.index("# resolved at start:"):]
    assert "one Ray node: TransferQueue binds 127.0.0.1" in tail
    assert "more than one Ray node: TransferQueue binds 0.0.0.0, advertises the driver's node address" in tail
    assert "relay store on the driver's node address" in tail
