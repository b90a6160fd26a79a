"""Ray mode: the controller and storage units as Ray actors placed by a placement group.

Bundle 0 holds the controller, bundles 1..n the storage units; with the default SPREAD strategy the
units land on different nodes when there are several, which spreads memory and bandwidth. Clients on
any node connect by the controller's address, exactly as in local mode. On the same node, clients
still move data through the units' shared-memory arenas. Across nodes the servers must bind a
reachable interface (``host="0.0.0.0"``), and then a shared secret is required; each server then advertises
its node's address as Ray knows it (unless ``advertise_host`` is set).
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict

from .config import TransferQueueConfig
from .deployment import PACKAGE_ROOT, Deployment, wait_ready
from .shm import new_shm_prefix, remove_leftovers, remove_stale


class _ServerActor:
    """Runs a controller or a storage unit on a background thread of a Ray actor."""

    def __init__(self, role: str, config: dict, unit: int = 0, controller: str = "",
                 shm_prefix: str | None = None):
        from ._server import config_from_dict

        cfg = config_from_dict(config)
        if cfg.host in ("0.0.0.0", "*", "") and not cfg.advertise_host:
            import dataclasses

            import ray

            # Bound to every interface: clients elsewhere dial this node's address as Ray knows it (the
            # hostname may not resolve on other nodes, or resolve to loopback).
            cfg = dataclasses.replace(cfg, advertise_host=ray.util.get_node_ip_address())
        if role == "controller":
            from .controller import Controller

            self.server = Controller(cfg)
        else:
            from .storage import StorageUnit

            self.server = StorageUnit(unit, cfg, controller, shm_prefix)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)


class RayDeployment(Deployment):
    """Controller + storage units as Ray actors (``ray.init`` is called if Ray is not running)."""

    def __init__(self, config: TransferQueueConfig):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config.validate()  # refuses a non-loopback binding without a secret
        if not ray.is_initialized():
            ray.init()
        self.config = config
        remove_stale()  # arenas of crashed runs on this host
        self.shm_prefix = new_shm_prefix()
        cpus = config.ray_num_cpus_per_actor
        bundles = [{"CPU": cpus} if cpus else {} for _ in range(1 + config.num_storage_units)]
        if not cpus:
            bundles = [{"CPU": 0.001} for _ in bundles]
        self._remove_pg = remove_placement_group
        self.pg = placement_group(bundles, strategy=config.ray_placement_strategy)
        self.actors = []
        try:
            ray.get(self.pg.ready(), timeout=config.rpc_timeout_s)
            path = os.environ.get("PYTHONPATH")
            runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, path) if p)}}
            actor_cls = ray.remote(_ServerActor)
            cfg = asdict(config)

            def make(index: int, *args):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
                actor = actor_cls.options(num_cpus=bundles[index]["CPU"], scheduling_strategy=strategy,
                                          runtime_env=runtime_env).remote(*args)
                self.actors.append(actor)
                return actor

            controller = make(0, "controller", cfg)
            self.address = ray.get(controller.address.remote(), timeout=config.rpc_timeout_s)
            units = [make(i + 1, "unit", cfg, i, self.address, self.shm_prefix)
                     for i in range(config.num_storage_units)]
            ray.get([u.address.remote() for u in units], timeout=config.rpc_timeout_s)
            wait_ready(self.address, config)
        except BaseException:
            self.shutdown()
            raise

    def kill_unit(self, index: int) -> None:
        """Kill one storage-unit actor (tests of failure handling)."""
        import ray

        ray.kill(self.actors[index + 1], no_restart=True)

    def shutdown(self) -> None:
        import ray

        if not self.actors and self.pg is None:
            return
        for actor in self.actors:  # controller first: it would report the stopped units as dead
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception:  # already dead or unreachable: kill below
                pass
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.pg is not None:
            self._remove_pg(self.pg)
            self.pg = None
        remove_leftovers(self.shm_prefix)
