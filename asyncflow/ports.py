"""Ports and addresses for process-group rendezvous: a free port, and this machine's address towards a host."""

from __future__ import annotations


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, below the kernel's ephemeral range where there is room.

    The port is bound later, by another process (a group's rank 0 seconds after placement picked it). A port from
    the ephemeral range could be handed meanwhile to any outgoing connection on the machine, and the group's store
    then fails with EADDRINUSE. Below the range only an explicit bind can take it, and the pick is random, so two
    pickers rarely meet."""
    import random
    import socket

    low, _ = ephemeral_range()
    candidates = range(max(10000, low // 2), low) if low > 11000 else range(0)
    for port in random.sample(candidates, min(50, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range (or all taken): the kernel's pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports of outgoing connections (Linux; the usual default elsewhere)."""
    try:
        from pathlib import Path

        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def local_address_towards(host: str) -> str:
    """This machine's address on its route to ``host`` (a UDP connect only picks the route; nothing is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return sock.getsockname()[0]


def interface_towards(host: str) -> str | None:
    """The network interface whose address this machine uses to reach ``host`` (None if none carries it)."""
    import psutil

    address = local_address_towards(host)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None
