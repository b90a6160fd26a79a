"""Which way each weight version travels: shared memory within a host, the relay between hosts.

    exporting rank on host A ──stage──► its segment on A ──► rollout instances on A read it (shm)
                                              └──relay──► one receiver per other rollout host H ──► H's mirror
                                                                  rollout instances on H read the mirror

Every pair (exporting trainer rank, rollout instance) is decided from the hosts the two run on: the same host
reads the rank's staging segment, another host reads that host's mirror. Each rollout host has one receiver
(owned by its first rollout instance) and one mirror of every remote exporting rank, whatever the number of
rollout instances on it. A host is named by a *host key*: the Ray node id under ``weight_sync.transport:
auto``; the explicit values, kept for tests, force one way for every pair (``shm``: every process counts as
one host; ``relay``: the trainer counts as a host of its own, so every pair relays, still one receiver and
one mirror per rollout host). The keys also name the version board's domains (``VersionBoard``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

LOCAL = "local"
"""The one host key of ``transport: shm`` (and of every run that never leaves one host)."""
TRAINER = "trainer"
"""The trainer's host key under ``transport: relay``: it never equals a rollout host, so every pair relays."""


def host_key(transport: str, node: str, side: str) -> str:
    """The host key of a process on Ray node ``node``; ``side`` is ``trainer`` or ``rollout``."""
    if transport == "shm":
        return LOCAL
    if transport == "relay" and side == "trainer":
        return TRAINER
    if transport not in ("auto", "relay"):
        raise ValueError(f"weight_sync.transport={transport!r}; choose auto, shm or relay")
    return node


def pair_transport(source_host: str, rollout_host: str) -> str:
    """``shm`` when the exporting rank and the rollout instance share a host, else ``relay``."""
    return "shm" if source_host == rollout_host else "relay"


def remote_hosts(source_host: str, rollout_hosts: Iterable[str]) -> list[str]:
    """The rollout hosts the exporting rank on ``source_host`` relays to, in its group's order: receiver i of
    the source's relay group (group rank i + 1) is the receiver of host ``remote_hosts(...)[i]``."""
    return sorted(set(rollout_hosts) - {source_host})


def receiver_owner(rollout_hosts: Sequence[str], instance: int) -> bool:
    """Whether rollout ``instance`` owns its host's relay receiver and mirror (the host's first instance)."""
    return rollout_hosts.index(rollout_hosts[instance]) == instance


def needs_relay(transport: str, trainer_nodes: Iterable[str], rollout_nodes: Iterable[str]) -> bool:
    """Whether any pair of trainer rank and rollout instance (Ray node ids) crosses hosts under ``transport``."""
    trainer = {host_key(transport, n, "trainer") for n in trainer_nodes}
    rollout = {host_key(transport, n, "rollout") for n in rollout_nodes}
    return any(pair_transport(t, r) == "relay" for t in trainer for r in rollout)


def describe(transport: str, trainer_nodes: Sequence[str], rollout_nodes: Sequence[str]) -> list[str]:
    """One line per (trainer rank, rollout instance) pair: the transport chosen and why (``config show``,
    logs). Ranks are listed in group order; every rank is listed, though only the exporting ones send."""
    lines = []
    for rank, t in enumerate(trainer_nodes):
        for instance, r in enumerate(rollout_nodes):
            way = pair_transport(host_key(transport, t, "trainer"), host_key(transport, r, "rollout"))
            why = ("forced by weight_sync.transport" if transport != "auto"
                   else "same node" if way == "shm" else "different nodes")
            lines.append(f"trainer rank {rank} -> rollout {instance}: {way} ({why})")
    return lines
