"""What every TransferQueue deployment shares: the ``Deployment`` handle and the wait for its servers.

``deploy`` (threads, processes) and ``ray_deploy`` (Ray actors) both build on it; ``deploy.start`` picks one.
"""

from __future__ import annotations

import os
import time

from .config import TransferQueueConfig
from .errors import ServerUnavailableError

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The folder that holds the ``asyncflow`` package: server processes put it on their ``PYTHONPATH``."""


class Deployment:
    """A running controller and its storage units; hand ``address`` to clients anywhere."""

    address: str
    config: TransferQueueConfig

    def client(self, writer: str | None = None):
        """A synchronous client connected to this deployment (``writer``: see ``TransferQueueClient``)."""
        from .client import TransferQueueClient

        return TransferQueueClient(self.address, self.config, writer=writer)

    def async_client(self, writer: str | None = None):
        """An asyncio client (call ``await client.connect()`` before use; ``writer``: see ``TransferQueueClient``)."""
        from .async_client import AsyncTransferQueueClient

        return AsyncTransferQueueClient(self.address, self.config, writer=writer)

    def shutdown(self) -> None:
        """Stop the servers this deployment started and remove its shared memory (idempotent)."""
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()



def wait_ready(address: str, config: TransferQueueConfig, procs=None) -> None:
    """Return once every storage unit has registered with the controller."""
    import zmq

    from .protocol import Signer
    from .transport import Connection

    ctx = zmq.Context()
    conn = Connection(ctx, address, Signer(config.secret), "controller", config.max_message_bytes)
    try:
        deadline = time.monotonic() + config.rpc_timeout_s
        while time.monotonic() < deadline:
            if procs and any(p.poll() is not None for p in procs):
                raise ServerUnavailableError("a TransferQueue server process exited during start-up")
            if conn.request({"op": "hello"}, timeout_s=config.rpc_timeout_s)[0].get("ready"):
                return
            time.sleep(0.01)
        raise ServerUnavailableError("storage units did not register in time")
    finally:
        conn.close()
        ctx.term()
