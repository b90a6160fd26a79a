"""``SyncSession``: the plain-data handshake that pairs Megatron exporting ranks with vLLM receiver ranks.

    driver:  session = SyncSession(cfg, num_receivers)      # once per trainer/rollout pairing
             link = session.link(version)                   # a fresh group name per version
    trainer (every rank, concurrently):  trainer.export_weights(link, cfg.bucket_mb)
    rollout:                             rollout.sync_weights(link, plan_dict, version)

``link`` and the plan are dicts of strings and numbers, so they cross Ray, rpc or msgpack unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid

from asyncflow.bridge.config import WeightSyncConfig
from asyncflow.bridge.transport import LinkSpec
from asyncflow.engines.megatron.parallel import free_port


class SyncSession:
    """Names the store and groups for each weight version of one trainer -> rollout pairing."""

    def __init__(self, cfg: WeightSyncConfig, num_receivers: int):
        self.cfg, self.num_receivers = cfg, num_receivers
        self.id = uuid.uuid4().hex[:10]
        self.store_path = ""
        if cfg.transport == "shm":
            # /dev/shm keeps the FileStore off disk; nothing listens on a port for same-host syncs.
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self.store_path = os.path.join(folder, f"asyncflow-sync-{self.id}.store")
        self.port = cfg.port or (free_port() if cfg.transport == "broadcast" else 0)

    def link(self, version: int) -> dict:
        """The ``LinkSpec`` dict for syncing ``version``: fresh group names, so versions never mix."""
        spec = LinkSpec(
            self.cfg.transport,
            f"{self.id}v{version}",
            self.num_receivers,
            self.cfg.backend,
            self.store_path,
            self.cfg.host,
            self.port,
            self.cfg.timeout_s,
        )
        return dataclasses.asdict(spec)

    def close(self) -> None:
        """Remove the store file (shm transport)."""
        if self.store_path and os.path.exists(self.store_path):
            os.unlink(self.store_path)
