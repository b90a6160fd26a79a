"""Configuration of the TransferQueue (controller, storage units, clients and transport).

Every default of the data plane lives here and nowhere else; recipes override fields in YAML and the
global AsyncFlow config nests this dataclass as ``transfer_queue``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransferQueueConfig:
    """Settings of one TransferQueue deployment and of the clients that talk to it."""

    host: str = "127.0.0.1"
    """Interface the controller and storage units bind to. Loopback by default so that nothing is
    reachable from other machines unless a cluster deployment asks for it (e.g. "0.0.0.0")."""

    advertise_host: str | None = None
    """Address that clients on other nodes use to reach the servers. None means ``host`` (or, when
    ``host`` is a wildcard, this machine's hostname)."""

    controller_port: int = 0
    """TCP port of the controller; 0 picks a free port."""

    num_storage_units: int = 2
    """How many storage units hold the rows; rows of each put are spread over them."""

    storage_unit_capacity_bytes: int = 4 << 30
    """Memory of one storage unit. Puts that do not fit wait for space (back-pressure) rather than grow
    memory without bound. The arena is sparse, so unused capacity costs no RAM."""

    max_rows: int = 0
    """Cap on live rows over all partitions; new rows beyond it wait for clears. 0 means no row cap
    (the byte capacity still applies)."""

    get_timeout_s: float = 600.0
    """Default time a blocking request waits for enough ready rows before raising a timeout error."""

    put_timeout_s: float = 600.0
    """Default time a put waits for capacity (back-pressure) before raising a timeout error."""

    rpc_timeout_s: float = 60.0
    """Time a client waits for any single reply (other than a parked blocking request) before it
    declares the server unresponsive."""

    heartbeat_interval_s: float = 0.5
    """How often storage units report to the controller."""

    heartbeat_timeout_s: float = 30.0
    """A storage unit silent for this long is declared dead; requests that need its rows fail. Generous, because a
    busy host delays heartbeats by seconds; a unit whose process died is declared dead about a second after its
    connection closed, whatever this is (``membership.LINK_GRACE_S``)."""

    shm_enabled: bool = True
    """Move large payloads between processes of one host through shared memory instead of sockets."""

    shm_threshold_bytes: int = 0
    """Per storage unit and request, payloads smaller than this go over ZMQ even on the same host.
    0 (default): always use the mapped arena when it is reachable, which is cheaper at every size
    because the arena is mapped once per client (no per-request segment)."""

    secret: str | None = field(default=None, repr=False)
    """Shared secret. When set every message carries a keyed BLAKE2b tag and untagged or wrongly
    tagged messages are dropped. None: the "processes" and "ray" deployments generate a random one at
    start and hand it to clients through the deployment's ``config`` (``Deployment.client()``); the
    "threads" deployment (tests, one process) runs without one, on loopback only. A server bound to a
    non-loopback ``host`` refuses to start without a secret in every mode. Never printed: ``repr``
    leaves it out and config dumps and metrics sinks redact it."""

    max_message_bytes: int = 4 << 30
    """Largest inbound ZMQ message a storage unit accepts (write payloads); bigger ones are refused by
    ZMQ itself while reading the size prefix, before any byte is buffered or hashed."""

    max_request_bytes: int = 64 << 20
    """Largest inbound message the controller accepts. Its requests are metadata only (a put of a
    million object rows describes itself in a few MiB), so a hostile peer cannot make it buffer or hash
    gigabytes."""

    receive_queue_messages: int = 10000
    """Bound on each server's receive queue (ZMQ high-water mark, per peer connection). A peer that
    floods a busy server is held back by TCP flow control instead of growing the server's memory."""

    row_lease_s: float = 600.0
    """Rows handed out by ``get_meta`` are leased to the consumer for this long. If it neither acks
    (reads) nor renews them in time, they return to the task (counted in ``status`` as
    ``lease_expired``), so a consumer that died or gave up never strands rows in flight."""

    put_lease_s: float = 120.0
    """Time a prepared put has to write its bytes and commit. The writer checks its lease before it
    copies into an arena; afterwards the put is rolled back, its ranges fenced on the storage units and
    reused only once no writer can still hold them."""

    sampler_modules: list[str] = field(default_factory=list)
    """Modules the controller imports at start-up, so that samplers they register with
    ``@register_sampler`` can be named in requests (request names never import code)."""

    deployment: str = "processes"
    """How ``start`` runs the servers: "threads" (tests, debugging), "processes" (one machine) or
    "ray" (actors placed by a placement group)."""

    ray_num_cpus_per_actor: float = 0.5
    """CPU reservation of each controller or storage-unit Ray actor."""

    ray_placement_strategy: str = "SPREAD"
    """Placement-group strategy for the storage-unit actors ("SPREAD", "PACK", "STRICT_SPREAD")."""

    @property
    def loopback(self) -> bool:
        """True when the servers bind to this host's loopback interface only."""
        return is_loopback(self.host)

    def validate(self) -> None:
        """Raise ValueError on settings that cannot work, naming the field."""
        if self.num_storage_units < 1:
            raise ValueError(f"num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.storage_unit_capacity_bytes < 1 << 20:
            raise ValueError("storage_unit_capacity_bytes must be at least 1 MiB")
        for name in ("get_timeout_s", "put_timeout_s", "rpc_timeout_s", "heartbeat_interval_s",
                     "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        if self.deployment not in ("threads", "processes", "ray"):
            raise ValueError(f"deployment must be threads, processes or ray, got {self.deployment!r}")
        if self.max_rows < 0:
            raise ValueError("max_rows must be >= 0")
        for name in ("row_lease_s", "put_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_request_bytes < 1 << 16 or self.receive_queue_messages < 1:
            raise ValueError("max_request_bytes must be >= 64 KiB and receive_queue_messages >= 1")
        if not self.loopback and not self.secret:
            raise ValueError(f"host={self.host!r} is reachable from other machines: set "
                             "transfer_queue.secret (every mode refuses an open binding without one)")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface (so nothing outside this machine can connect)."""
    return host in ("localhost", "::1") or host.startswith("127.")
