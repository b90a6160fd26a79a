"""Where the run's servers listen: chosen at start from the Ray cluster, never by hand.

One node: everything stays on loopback (the TransferQueue, the relay store), as configured by default.
More than one alive node: a service on another node must reach the driver's servers, so

- the TransferQueue binds all interfaces and advertises each server's node address as Ray knows it (the
  driver's node for the "threads" and "processes" deployments; each actor's own node for "ray", where
  ``asyncflow.transfer_queue.ray_deploy`` looks it up), with a shared secret that reaches every client through
  the deployment's config;
- the weight relay's rendezvous store listens on the driver's node address.

Settings the user changed away from loopback are kept as given. Same-host shared memory needs no choice here:
a TransferQueue client maps a storage unit's arena only when the unit reports the same host identity
(``asyncflow.transfer_queue.shm.host_id``), so clients on other hosts use sockets.
"""

from __future__ import annotations

import dataclasses
import secrets

from asyncflow.config import AsyncFlowConfig
from asyncflow.transfer_queue.config import TransferQueueConfig, is_loopback

ALL_INTERFACES = "0.0.0.0"


@dataclasses.dataclass
class NetworkChoice:
    """What a run uses, and why (``notes`` are printed at start and by ``asyncflow config show``)."""

    nodes: int
    driver_address: str
    tq: TransferQueueConfig
    store_host: str
    notes: list[str]

    def log_line(self) -> str:
        return "network: " + "; ".join(self.notes)


def alive_nodes() -> list[dict]:
    """Alive nodes of the connected Ray cluster."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def resolve(cfg: AsyncFlowConfig, nodes: int, driver_address: str) -> NetworkChoice:
    """The TransferQueue and relay-store settings for a cluster of ``nodes`` alive nodes, the driver's node at
    ``driver_address`` (pure: tested without Ray)."""
    tq, store_host = cfg.transfer_queue, cfg.weight_sync.store_host
    if nodes <= 1:
        notes = [f"one Ray node: TransferQueue on {tq.host}, relay store on {store_host}"]
        return NetworkChoice(nodes, driver_address, tq, store_host, notes)
    notes = []
    if tq.loopback:
        per_node = "each storage unit's node address" if tq.deployment == "ray" else driver_address
        tq = dataclasses.replace(tq, host=ALL_INTERFACES,
                                 advertise_host=None if tq.deployment == "ray" else driver_address)
        notes.append(f"{nodes} Ray nodes: TransferQueue binds {ALL_INTERFACES} and advertises {per_node} "
                     f"(loopback is unreachable from other nodes)")
    else:
        notes.append(f"{nodes} Ray nodes: TransferQueue on {tq.host} as configured")
    if tq.secret is None:
        # Bound beyond loopback: every message must carry the run's secret (clients get it with the config).
        tq = dataclasses.replace(tq, secret=secrets.token_hex(32))
    notes.append("TransferQueue messages signed with a per-run secret")
    if is_loopback(store_host):
        store_host = driver_address
        notes.append(f"relay store on the driver's node address {driver_address}")
    else:
        notes.append(f"relay store on {store_host} as configured")
    return NetworkChoice(nodes, driver_address, tq, store_host, notes)


def resolve_connected(cfg: AsyncFlowConfig) -> NetworkChoice:
    """``resolve`` for the Ray cluster this process is connected to."""
    import ray

    return resolve(cfg, len(alive_nodes()), ray.util.get_node_ip_address())


def rule(cfg: AsyncFlowConfig) -> list[str]:
    """What ``resolve`` will choose at start, for ``asyncflow config show`` (no cluster is contacted)."""
    tq, store = cfg.transfer_queue, cfg.weight_sync.store_host
    lines = [f"one Ray node: TransferQueue binds {tq.host}, relay store on {store}"]
    if tq.loopback:
        where = "each storage unit's node address" if tq.deployment == "ray" else "the driver's node address"
        lines.append(f"more than one Ray node: TransferQueue binds {ALL_INTERFACES}, advertises {where}, "
                     "per-run secret")
    else:
        lines.append(f"more than one Ray node: TransferQueue on {tq.host} as configured")
    lines.append("more than one Ray node: relay store on " +
                 ("the driver's node address" if is_loopback(store) else f"{store} as configured"))
    if cfg.weight_sync.transport == "auto":
        lines.append("weights: per (trainer rank, rollout instance) pair, shm on one node, the relay between nodes")
    else:
        lines.append(f"weights: weight_sync.transport={cfg.weight_sync.transport} for every pair, as configured")
    return lines


def tq_layout(tq, client, workers: list) -> dict:
    """The TransferQueue's addresses (bind, advertised, controller, storage units) and, per worker, its node, the
    address it was given and the payload bytes its client moved by shared memory and by socket (``layout.json``)."""
    import ray

    return {"bind": tq.config.host, "advertise": tq.config.advertise_host, "controller": tq.address,
            "units": [u["address"] for u in client.status()["units"].values()],
            "workers": ray.get([w.transfers.remote() for w in workers], timeout=30)}
