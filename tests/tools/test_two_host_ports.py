"""``tools/two_host.py`` gives each Ray component of a node a port of its own: ports are probed free and released at
once, so two probes may return the same port, and Ray then refuses to start the node ("trying to use a port number
... that is used by other components": a host-loss test of the suite was skipped for it). No root needed: only the
arguments are made. And none where another process of the machine may take one meanwhile: a connection's port or a
port-0 bind (the head's runtime-env agent found its port taken once, and the cluster died after it was up)."""

import re

from tests.cluster.conftest import load_two_host


def _ports(args: list[str]) -> tuple[dict[str, int], range]:
    flags = dict(re.fullmatch(r"(--[a-z-]+)=(\d+)", a).groups() for a in args if re.fullmatch(r"--[a-z-]+=\d+", a))
    ports = {flag: int(value) for flag, value in flags.items() if flag.endswith("-port")}
    low, high = ports.pop("--min-worker-port"), ports.pop("--max-worker-port")
    return ports, range(low, high + 1)


def test_every_component_port_of_a_node_is_its_own_and_outside_the_worker_range():
    two_host = load_two_host()
    for _ in range(300):
        cluster = two_host.TwoHost(suffix="x", netns="x", veth_a="a", veth_b="b", addr_a="198.51.100.1",
                                   addr_b="198.51.100.2", hostname_b="b", temp_dir="/tmp/x",
                                   port=two_host._free_port(), token="t")
        for host, flags in (("a", ("--dashboard-port",)), ("b", ())):
            ports, workers = _ports(two_host._ray_args(cluster, host, 4, flags))
            assert len(ports) == len(two_host._RAY_PORT_FLAGS) + len(flags)
            used = [*ports.values(), cluster.port]
            assert len(set(used)) == len(used), ports
            assert not [p for p in used if p in workers], (ports, workers)
            # None where the kernel hands out ports to connections and port-0 binds, nor in Ray's default worker
            # ports of the machine's local Ray instances.
            low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
            assert all(20000 <= p < low for p in [*used, *workers]), (ports, workers)
