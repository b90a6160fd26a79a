"""A two-host Ray cluster inside one machine: host B is a network namespace joined to host A by a veth pair.

Host A is this machine's root namespace; host B is a network namespace with its own mount namespace (a private
tmpfs on /dev/shm, so no shared-memory segment of host A is visible there) and its own hostname. Their addresses
are a /30 out of 198.51.100.0/24 (a documentation range, routed nowhere); host B's default route points at
host A, which does not forward, so B reaches A's own addresses and nothing beyond. A Ray head listens on host A's veth
address and a Ray node runs in host B; each declares ``devices`` units of a custom resource (``NPU``: recipes set
``ray.accelerator: NPU``; engines still compute on the CPU). Ray token authentication is always on, with a fresh
token per cluster (Ray turns it on by itself when ``~/.ray/auth_token`` exists; every process then needs it).

Every name is unique per run (namespace, veth, temp folder, ports), so two runs on one machine never collide, and
``down`` removes exactly what ``up`` made: the two ``ray start --block`` processes it started (each stops the Ray
processes it spawned), whatever is left in the namespace, Ray processes of its own temp folder, the veth, the
namespace and the shared-memory segments its host-A processes had mapped. Needs root (CI runs as root).

Library: ``cluster = up(); ...; down(cluster)``; ``cluster.env()`` is the environment a driver needs
(``ray.init(address=cluster.address)`` or ``asyncflow train ... ray.address=<cluster.address>``).
CLI: ``python tools/two_host.py up`` (prints the state file), ``status STATE``, ``down STATE``; ``table LAYOUT``
prints a run's bytes per transport per host from its ``layout.json`` (``bytes_table``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from asyncflow.ports import ephemeral_range

NETWORK = ipaddress.ip_network("198.51.100.0/24")
_RAY_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                   "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                   "--ray-client-server-port")


class TwoHostError(RuntimeError):
    """The two-host cluster cannot be made here (no root, no ``ip``/``unshare``, or a start that failed)."""


@dataclass
class TwoHost:
    """A running two-host cluster and everything needed to remove it (JSON-serialisable)."""

    suffix: str
    netns: str
    veth_a: str
    veth_b: str
    addr_a: str
    addr_b: str
    hostname_b: str
    temp_dir: str
    port: int
    token: str = field(repr=False)
    resource: str = "NPU"
    devices: int = 2
    devices_b: int | None = None
    """Devices of host B when it differs from host A's ``devices`` (a layout that pins work to one host)."""
    pids: dict[str, int] = field(default_factory=dict)
    """``ray start --block`` processes this cluster started: "a" (head) and "b" (node in the namespace)."""
    shm_a: list[str] = field(default_factory=list)
    """Host A shared-memory segments seen mapped by this cluster's processes (removed at ``down``)."""

    @property
    def address(self) -> str:
        """``host:port`` of the Ray head (GCS), for ``ray.init`` and ``ray.address``."""
        return f"{self.addr_a}:{self.port}"

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process's environment) plus the token a process needs to join this cluster."""
        env = dict(os.environ if base is None else base)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        env.pop("RAY_ADDRESS", None)
        return env

    def in_b(self, *cmd: str, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` on host B (its network namespace and the mount namespace of its Ray node)."""
        pid = self.pids.get("b_inner") or self.pids["b"]
        # nsenter into the Ray node's mount namespace too: a plain `ip netns exec` would see host A's /dev/shm.
        return subprocess.run(["nsenter", "-t", str(pid), "-m", "-u", "-n", *cmd], capture_output=True,
                              text=True, **kwargs)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))
        os.chmod(path, 0o600)  # holds the Ray token

    @classmethod
    def load(cls, path: Path) -> TwoHost:
        return cls(**json.loads(Path(path).read_text()))


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise TwoHostError(f"`{shlex.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


COMPONENT_PORTS = range(20000, 22000)
"""Where a node's component ports are picked: below the kernel's ephemeral ports (32768 and up by default), where
no connection and no socket bound to port 0 lands (one took a port probed free before Ray bound it, and the head's
raylet died 10 s after the cluster was up), and above the worker ports of the local Ray instances other processes
of the machine may run (10002-19999 by default)."""
WORKER_BLOCK = 201
WORKER_BLOCKS = range(22000, ephemeral_range()[0] - WORKER_BLOCK, WORKER_BLOCK)
"""Where each node's worker-port range (``WORKER_BLOCK`` ports) starts: apart from the component ports, so that
another cluster's components never take one, and below the kernel's ephemeral ports as read on this machine."""


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_port(taken: set[int] | None = None) -> int:
    """A port of ``COMPONENT_PORTS`` free now and not in ``taken``, to which it is added: a port probed free is
    released at once, so a later probe may pick it again, and Ray refuses a port given to two of its components."""
    taken = set() if taken is None else taken
    for _ in range(200):
        port = COMPONENT_PORTS[secrets.randbelow(len(COMPONENT_PORTS))]
        if port not in taken and _is_free(port):
            taken.add(port)
            return port
    raise TwoHostError(f"no free port in {COMPONENT_PORTS} outside {sorted(taken)}")


def _free_worker_ports() -> range:
    """A block of ``WORKER_BLOCKS`` whose every port is free now (the workers bind theirs as they start)."""
    for _ in range(100):
        start = WORKER_BLOCKS[secrets.randbelow(len(WORKER_BLOCKS))]
        if all(_is_free(port) for port in range(start, start + WORKER_BLOCK)):
            return range(start, start + WORKER_BLOCK)
    raise TwoHostError(f"no block of {WORKER_BLOCK} free ports in {WORKER_BLOCKS.start}-{WORKER_BLOCKS.stop}")


def _pick_subnet() -> tuple[str, str]:
    """Two addresses of a /30 of NETWORK that no interface of this machine uses yet."""
    used = _run("ip", "-o", "-4", "addr", "show")
    for _ in range(100):
        net = list(NETWORK.subnets(new_prefix=30))[secrets.randbelow(64)]
        a, b = (str(h) for h in net.hosts())
        if f" {a}/" not in used and f" {b}/" not in used:
            return a, b
    raise TwoHostError("no free /30 left in 198.51.100.0/24")


def check_possible() -> None:
    """Raise TwoHostError saying why namespaces cannot be made here (not root, tools missing)."""
    if os.geteuid() != 0:
        raise TwoHostError("creating a network namespace needs root (CI runs as root)")
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            raise TwoHostError(f"'{tool}' is not installed (apt-get install iproute2 util-linux)")


def _ray_bin() -> str:
    ray = Path(sys.executable).with_name("ray")
    return str(ray) if ray.exists() else "ray"


def _ray_args(cluster: TwoHost, host: str, cpus: int, flags: tuple[str, ...] = (),
              ray_cli: list[str] | None = None) -> list[str]:
    """``ray start`` for ``host``, every component port its own (``flags`` name more ports to pick, the head's)."""
    args = [*(ray_cli or [_ray_bin()]), "start", "--block", "--disable-usage-stats", f"--num-cpus={cpus}",
            f"--resources={json.dumps({cluster.resource: _devices(cluster, host)})}",
            "--object-store-memory=100000000",
            f"--temp-dir={cluster.temp_dir}/{host}"]
    taken = {cluster.port}
    workers = _free_worker_ports()
    args += [f"{flag}={_free_port(taken)}" for flag in _RAY_PORT_FLAGS + flags]
    return args + [f"--min-worker-port={workers.start}", f"--max-worker-port={workers.stop - 1}"]


def _devices(cluster: TwoHost, host: str) -> int:
    return cluster.devices_b if host == "b" and cluster.devices_b is not None else cluster.devices


def up(devices: int = 2, cpus: int = 4, resource: str = "NPU", wait_s: float = 120.0,
       devices_b: int | None = None, ray_cli: list[str] | None = None, env_a: dict | None = None,
       env_b: dict | None = None, before_b: str | None = None) -> TwoHost:
    """Create host B, start Ray on both hosts and wait until the cluster has two alive nodes.

    ``ray_cli`` is the command that runs Ray's CLI on both hosts (default: this environment's ``ray``);
    ``env_a`` / ``env_b`` add to the environment of each host's Ray node, which its workers inherit; ``before_b``
    is a shell command that host B starts in the background, in its namespaces, just before its Ray node. The
    tests use these to fork each host's workers from a server that has imported what they need.
    On any failure, everything made so far is removed and TwoHostError says why.
    """
    check_possible()
    suffix = secrets.token_hex(3)
    addr_a, addr_b = _pick_subnet()
    temp_dir = f"/tmp/th-{suffix}"  # short: Ray's socket paths must stay under 108 characters
    cluster = TwoHost(suffix=suffix, netns=f"th-{suffix}", veth_a=f"tha{suffix}", veth_b=f"thb{suffix}",
                      addr_a=addr_a, addr_b=addr_b, hostname_b=f"hostb-{suffix}", temp_dir=temp_dir,
                      port=_free_port(), token=secrets.token_hex(32), resource=resource, devices=devices,
                      devices_b=devices_b)
    os.makedirs(temp_dir, mode=0o700)
    try:
        _make_network(cluster)
        env = cluster.env()
        head = _ray_args(cluster, "a", cpus, ("--dashboard-port",), ray_cli) + [
            "--head", f"--node-ip-address={addr_a}", f"--port={cluster.port}", "--include-dashboard=false"]
        cluster.pids["a"] = _spawn(head, {**env, **(env_a or {})}, Path(temp_dir) / "ray_a.log")
        node = shlex.join(_ray_args(cluster, "b", cpus, (), ray_cli) + [f"--address={cluster.address}",
                                                                        f"--node-ip-address={addr_b}"])
        # A private tmpfs on /dev/shm and another hostname: host B shares no segment with host A.
        # Its hostname resolves to its own address there, as on a real cluster host (gloo looks it up).
        hosts = Path(temp_dir) / "hosts_b"
        hosts.write_text(f"127.0.0.1 localhost\n{addr_b} {cluster.hostname_b}\n")
        inner = (f"mount -t tmpfs -o size=8g,mode=1777 tmpfs /dev/shm && mount --bind {hosts} /etc/hosts && "
                 f"hostname {cluster.hostname_b} && "
                 f"echo $$ > {temp_dir}/b_inner.pid || exit 1; {f'({before_b}) & ' if before_b else ''}exec {node}")
        cluster.pids["b"] = _spawn(["ip", "netns", "exec", cluster.netns, "unshare", "-mu", "--fork",
                                    "--kill-child=SIGTERM", "sh", "-c", inner], {**env, **(env_b or {})},
                                   Path(temp_dir) / "ray_b.log")
        _wait_nodes(cluster, wait_s)
        cluster.pids["b_inner"] = int((Path(temp_dir) / "b_inner.pid").read_text())
    except BaseException:
        down(cluster)
        raise
    return cluster


def _make_network(c: TwoHost) -> None:
    _run("ip", "netns", "add", c.netns)
    _run("ip", "link", "add", c.veth_a, "type", "veth", "peer", "name", c.veth_b)
    _run("ip", "link", "set", c.veth_b, "netns", c.netns)
    _run("ip", "addr", "add", f"{c.addr_a}/30", "dev", c.veth_a)
    _run("ip", "link", "set", c.veth_a, "up")
    for cmd in (("addr", "add", f"{c.addr_b}/30", "dev", c.veth_b), ("link", "set", c.veth_b, "up"),
                ("link", "set", "lo", "up"), ("route", "add", "default", "via", c.addr_a)):
        _run("ip", "-n", c.netns, *cmd)


def _spawn(cmd: list[str], env: dict, log: Path) -> int:
    with open(log, "ab") as out:
        # Its own session: a Ctrl-C of the caller does not reach Ray, and `down` signals exactly this process.
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True).pid


def _wait_nodes(c: TwoHost, wait_s: float) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(sum(n['Alive'] for n in ray.nodes())); ray.shutdown()")
    deadline = time.monotonic() + wait_s
    last = ""
    while time.monotonic() < deadline:
        for name in ("a", "b"):
            if not _alive(c.pids[name]):
                log = (Path(c.temp_dir) / f"ray_{name}.log").read_text()[-2000:]
                raise TwoHostError(f"ray start on host {name.upper()} exited:\n{log}")
        try:
            proc = subprocess.run([sys.executable, "-c", probe, c.address], capture_output=True, text=True,
                                  env=c.env(), timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            last = "the probe did not connect"
            continue
        last = proc.stdout.strip().splitlines()[-1:] or proc.stderr[-500:]
        if proc.returncode == 0 and last == ["2"]:
            return
        time.sleep(2)
    raise TwoHostError(f"the two-host Ray cluster did not come up within {wait_s:g} s: {last}")


def node_ids(c: TwoHost) -> dict[str, str]:
    """``{"a": node id, "b": node id}``: each host's Ray node id, e.g. for ``ray.rollout_label_selector``
    (``{"ray.io/node-id": ...}``) to put work on one host."""
    probe = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(json.dumps({n['NodeManagerAddress']: n['NodeID'] for n in ray.nodes() if n['Alive']}))")
    proc = subprocess.run([sys.executable, "-c", probe, c.address], capture_output=True, text=True, env=c.env(),
                          timeout=120)
    if proc.returncode:
        raise TwoHostError(f"could not list the cluster's nodes: {proc.stderr[-1000:]}")
    nodes = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"a": nodes[c.addr_a], "b": nodes[c.addr_b]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our own exited child) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def _own_host_a_pids(c: TwoHost) -> list[int]:
    """Processes of host A started by this cluster's Ray: their command line names its private temp folder."""
    marker = f"{c.temp_dir}/a".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _mapped_shm(pids: list[int]) -> set[str]:
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(line.split("/dev/shm/", 1)[1].split(" ")[0] for line in maps.splitlines()
                     if "/dev/shm/" in line)
    return names


def _stop(pids: list[int], grace_s: float = 15.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _netns_pids(c: TwoHost) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", c.netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def down(c: TwoHost) -> None:
    """Remove everything ``up`` made (safe on a half-made cluster and when called twice)."""
    own_a = _own_host_a_pids(c)
    c.shm_a = sorted(set(c.shm_a) | {n for n in _mapped_shm(own_a) if not n.startswith("sem.")})
    # Each `ray start --block` stops the raylet / GCS it spawned; then whatever is left of ours. Host B's is
    # signalled itself: `unshare --fork` above it ignores SIGTERM and exits with its child.
    _stop([p for p in (c.pids.get("a"), c.pids.get("b_inner") or c.pids.get("b")) if p])
    _stop(_netns_pids(c) + _own_host_a_pids(c) + [p for k, p in c.pids.items() if k == "b"], grace_s=5.0)
    for pid in (c.pids.get("a"), c.pids.get("b")):
        if pid:
            try:
                os.waitpid(pid, os.WNOHANG)  # reap when this process is the parent (library use)
            except ChildProcessError:
                pass
    subprocess.run(["ip", "link", "del", c.veth_a], capture_output=True)  # also removes the peer in host B
    subprocess.run(["ip", "netns", "del", c.netns], capture_output=True)
    for name in c.shm_a:
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass
    shutil.rmtree(c.temp_dir, ignore_errors=True)


def status(c: TwoHost) -> dict:
    """What of the cluster exists now: namespace, veth, and each recorded Ray process."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show", c.veth_a], capture_output=True, text=True)
    return {"address": c.address, "host_a": c.addr_a, "host_b": c.addr_b, "netns": c.netns in netns.split(),
            "veth": links.returncode == 0, "ray": {k: _alive(p) for k, p in c.pids.items()},
            "netns_pids": len(_netns_pids(c))}


def weight_reads(layout: dict) -> list[dict]:
    """Every (rollout instance, exporting rank) pair of a run's ``layout.json``: both nodes, the way the bytes
    came (``shm``: the rank's own staging segment; ``relay``: the rollout host's mirror) and the bytes the
    instance's vLLM ranks read, over every applied version."""
    source_ip = {a["weights"]["source"]: a["node_ip"] for a in layout["actor"] if a["weights"].get("source")}
    return [{"rollout": i, "rollout_ip": r["node_ip"], "source": key, "source_ip": source_ip.get(key),
             "via": read["via"], "bytes": read["bytes"]}
            for i, r in enumerate(layout["rollout"]) for key, read in sorted(r["weights"]["read_by_source"].items())]


def bytes_table(layout: dict) -> list[tuple[str, str, int]]:
    """``(host, transport, bytes)`` per host of a run's ``layout.json``: the weights rollout read from same-host
    staging segments and from relay mirrors, the bytes the host's exporting ranks broadcast and its relay
    receivers took off the network, and the
    TransferQueue payload its clients moved by shared memory and by socket."""
    hosts = sorted({r["node_ip"] for r in layout["rollout"]} | {a["node_ip"] for a in layout["actor"]} |
                   {w["node_ip"] for w in layout["transfer_queue"]["workers"]})
    rows = []
    for host in hosts:
        rollout = [r["weights"] for r in layout["rollout"] if r["node_ip"] == host]
        sent = sum(a["weights"].get("relay_sent_bytes", 0) for a in layout["actor"] if a["node_ip"] == host)
        tq = [w["moved_bytes"] for w in layout["transfer_queue"]["workers"] if w["node_ip"] == host]
        rows += [(host, "weights: shm staging read", sum(w["read_bytes"].get("shm", 0) for w in rollout)),
                 (host, "weights: relay mirror read", sum(w["read_bytes"].get("relay", 0) for w in rollout)),
                 (host, "weights: relay network sent", sent),
                 (host, "weights: relay network received", sum(w["relay_received_bytes"] for w in rollout)),
                 (host, "transfer queue: shm", sum(m["shm"] for m in tq)),
                 (host, "transfer queue: socket", sum(m["socket"] for m in tq))]
    return rows


def format_table(rows: list[tuple[str, str, int]]) -> str:
    """``bytes_table`` as a Markdown table."""
    lines = ["| host | transport | bytes |", "|---|---|---:|"]
    return "\n".join(lines + [f"| {h} | {t} | {b:,} |" for h, t, b in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="make the cluster; prints the state file to pass to status/down")
    p_up.add_argument("--devices", type=int, default=2)
    p_up.add_argument("--cpus", type=int, default=4)
    for name in ("status", "down"):
        sub.add_parser(name).add_argument("state", type=Path)
    sub.add_parser("table", help="bytes per transport per host of a run's layout.json").add_argument(
        "layout", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "table":
            print(format_table(bytes_table(json.loads(args.layout.read_text()))))
        elif args.cmd == "up":
            cluster = up(args.devices, args.cpus)
            state = Path(cluster.temp_dir) / "state.json"
            cluster.save(state)
            print(state)
            print(f"# export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(python -c \"import json;print(json.load("
                  f"open('{state}'))['token'])\"); ray.address={cluster.address}", file=sys.stderr)
        elif args.cmd == "status":
            print(json.dumps(status(TwoHost.load(args.state)), indent=1))
        else:
            down(TwoHost.load(args.state))
    except TwoHostError as exc:
        print(f"two_host: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
