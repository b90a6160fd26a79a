"""Where every worker runs: one Ray placement group, and the bundle and resources of each worker.

Two layouts:

- CPU (``ray.accelerator: null``, the tiny recipes): ``async`` gives rollout one core and the trainer side
  the others, pinned so side-by-side workers stay off each other's cores; ``sync`` (colocated) puts every
  worker in one bundle of all cores, taking turns.
- Devices (``ray.accelerator: GPU``, or ``NPU`` and other custom Ray resources): one bundle per trainer
  rank (one device each) and, in ``async`` and ``stream``, one per rollout engine (``rollout.tensor_parallel``
  devices, one node), warm spares included. The reference (``trainer.reference_placement`` ``colocated`` or
  ``offload``) and, when its parallel sizes match the actor's, the critic share the actor's devices (fractions
  of each device: the Megatron groups take turns on them); a reference placed ``own`` and a critic of another
  shape get devices of their own. In ``sync`` (the colocated baseline) rollout engines have no devices of their
  own either: engine i takes turns on trainer devices i*TP .. i*TP+TP-1 (``rollout_devices``).
  Ranks are given bundles node by node from the placement group's bundle-to-node map
  (``ranks_by_node``), so the consecutive ranks of a tensor-parallel (TP x EP) group always share a node,
  whatever order Ray put the bundles in; a node holding part of a group is a clear error. Megatron groups
  rendezvous at the node of their rank 0, so a data- or pipeline-parallel group may span nodes. Not run on
  real devices here (no GPU on the CI machines); the layout is tested on a local Ray cluster that declares
  devices it does not have, and across the two hosts of ``tools/two_host.py``.
"""

from __future__ import annotations

import math

from asyncflow.config import AsyncFlowConfig, ConfigError, MegatronConfig


def world_size(mcfg: MegatronConfig) -> int:
    """Ranks of a Megatron group: TP x PP x CP x DP."""
    return mcfg.tensor_parallel * mcfg.pipeline_parallel * mcfg.context_parallel * mcfg.data_parallel


def node_unit(mcfg: MegatronConfig) -> int:
    """Consecutive ranks that must share a node: a TP group, or with EP > 1 the TP x EP ranks its expert
    groups span (Megatron orders ranks tp-cp-ep-dp-pp, and expert groups etp-ep-dp-pp with ETP = TP)."""
    return mcfg.tensor_parallel * max(mcfg.expert_parallel, 1)


def ranks_by_node(bundle_nodes: dict[int, str], bundles: list[int], unit: int, what: str,
                  node_rank: dict[str, object] | None = None) -> list[int]:
    """The bundle of each rank of a group whose ranks may use ``bundles`` (one per rank), given the placement
    group's ``bundle index -> node id`` map: ranks fill one node's bundles before the next node's, so every run
    of ``unit`` consecutive ranks lies on one node. Nodes go in ``node_rank`` order (the placement passes node
    addresses: the same layout gives the same ranks to the same hosts in every run), else in the order of
    their first bundle.

    Raises ``ConfigError`` when a node holds a number of the group's bundles that is not a multiple of
    ``unit``: a group of ``unit`` ranks would then span nodes (``what`` names the group and its sizes).
    """
    per_node: dict[str, list[int]] = {}
    for b in bundles:
        per_node.setdefault(bundle_nodes[b], []).append(b)
    split = {node: len(held) for node, held in per_node.items() if len(held) % unit}
    if split:
        raise ConfigError(
            f"{what} needs {unit} consecutive ranks on one node, but the placement group put "
            f"{', '.join(f'{n} of its {len(bundles)} devices on node {node[:12]}' for node, n in split.items())}: "
            f"choose parallel sizes whose tensor-parallel (x expert-parallel) group fits the devices of a node")
    order = sorted(per_node, key=lambda n: node_rank[n]) if node_rank is not None else list(per_node)
    return [b for node in order for b in per_node[node]]


class Placement:
    """The placement group of a run and ``options`` for every worker (``ray.remote(cls).options(**opts)``)."""

    def __init__(self, cfg: AsyncFlowConfig, critic: bool, reference: bool):
        import ray
        from ray.util.placement_group import placement_group

        self.cfg, self.acc = cfg, cfg.ray.accelerator
        self.colocated = cfg.workflow.mode == "sync"
        self.cores = 2 if cfg.ray.num_cpus is None else max(int(cfg.ray.num_cpus), 1)
        if self.acc is None:
            bundles = [{"CPU": self.cores}] if self.colocated else [{"CPU": 1}, {"CPU": max(self.cores - 1, 1)}]
        else:
            bundles = self._device_bundles(critic, reference)
        self.bundles, self._device_ids = bundles, None
        labels = {}
        selector = cfg.ray.rollout_label_selector
        if selector and self.acc is not None and not self.colocated:  # rollout bundles first, one per engine
            n = cfg.workflow.rollout_instances
            per = [dict(s) for s in selector] if isinstance(selector, list) else [dict(selector)] * n
            labels = {"bundle_label_selector": per + [{}] * (len(bundles) - n)}
        self.pg = placement_group(bundles, strategy=cfg.ray.placement_strategy, **labels)
        ray.get(self.pg.ready(), timeout=cfg.ray.placement_timeout_s)
        from ray.util import placement_group_table

        self.bundle_nodes = {int(b): n for b, n in placement_group_table(self.pg)["bundles_to_node_id"].items()}
        self.node_rank = {n["NodeID"]: _address_key(n["NodeManagerAddress"]) for n in ray.nodes()}
        self.order = self._rank_bundles(critic, reference) if self.acc is not None else {}
        if self.acc is not None and self.colocated:
            self.rollout_devices(0)  # look the device ids up before any worker takes its share

    # ----------------------------------------------------------------- device layout
    def _device_bundles(self, critic: bool, reference: bool) -> list[dict]:
        bundles = self._whole_device_bundles(critic, reference)
        share = self.cfg.ray.device_fraction
        if share == 1.0:
            return bundles
        # Fractional bundles (rollout TP 1: ``config_rules.device_sharing``): Ray gives every worker in them the one
        # device they share (its CUDA_VISIBLE_DEVICES).
        return [{**b, self.acc: b[self.acc] * share} for b in bundles]

    def _whole_device_bundles(self, critic: bool, reference: bool) -> list[dict]:
        cfg, cpd, acc = self.cfg, self.cfg.ray.cpus_per_device, self.acc
        n_trainer = world_size(cfg.trainer)
        trainer = [{acc: 1, "CPU": cpd}] * n_trainer
        own_reference = reference and cfg.trainer.reference_placement == "own"
        own_critic = critic and world_size(cfg.critic) != n_trainer
        sharers = (["actor"] + (["reference"] if reference and not own_reference else [])
                   + (["critic"] if critic and not own_critic else []))
        if self.colocated:
            # The colocated baseline: rollout engine i takes turns with the trainer on devices i*TP .. i*TP+TP-1
            # (vLLM asleep while Megatron trains, Megatron offloaded while vLLM generates); the counts match
            # (``config_rules.sync_on_devices``).
            rollout, sharers = [], sharers + ["rollout"]
        else:  # one bundle per instance, then one per warm spare (``workflow.rollout_spares``)
            engines = cfg.workflow.rollout_instances + cfg.workflow.rollout_spares
            rollout = [{acc: cfg.rollout.tensor_parallel, "CPU": cpd}] * engines
        self.first = {name: len(rollout) for name in sharers}
        self.first["rollout"] = 0
        extra: list[dict] = []
        if own_reference:  # as many devices as the trainer, after the trainer's
            self.first["reference"] = len(rollout) + n_trainer
            extra += [{acc: 1, "CPU": cpd}] * n_trainer
        if own_critic:
            self.first["critic"] = len(rollout) + n_trainer + len(extra)
            extra += [{acc: 1, "CPU": cpd}] * world_size(cfg.critic)
        self.fraction = {name: 1.0 / len(sharers) for name in sharers}
        for name in ("reference", "critic"):
            self.fraction.setdefault(name, 1.0)
        return rollout + trainer + extra

    def _rank_bundles(self, critic: bool, reference: bool) -> dict[str, list[int]]:
        """Each Megatron group's bundle per rank, node by node (``ranks_by_node``)."""
        cfg, n_trainer = self.cfg, world_size(self.cfg.trainer)
        unit = node_unit(cfg.trainer)
        what = (f"trainer TP {cfg.trainer.tensor_parallel} x EP {cfg.trainer.expert_parallel} "
                f"over {n_trainer} devices")
        if self.colocated:  # rollout engine i takes turns on trainer ranks i*TP .. i*TP+TP-1: one node too
            unit = math.lcm(unit, cfg.rollout.tensor_parallel)
            what += f" (sharing them with rollout TP {cfg.rollout.tensor_parallel})"
        first = self.first["actor"]
        trainer = ranks_by_node(self.bundle_nodes, list(range(first, first + n_trainer)), unit, what, self.node_rank)
        order = {name: trainer for name in self.fraction if self.first.get(name) == first}
        for name, mcfg, wanted in (("reference", cfg.trainer, reference), ("critic", cfg.critic, critic)):
            if wanted and name not in order and name in self.first:  # devices of its own
                start, n = self.first[name], world_size(mcfg)
                order[name] = ranks_by_node(self.bundle_nodes, list(range(start, start + n)), node_unit(mcfg),
                                            f"{name} TP {mcfg.tensor_parallel} x EP {mcfg.expert_parallel}",
                                            self.node_rank)
        return order

    def node_of(self, bundle: int) -> str:
        """The Ray node id of ``bundle``."""
        return self.bundle_nodes[bundle]

    def rollout_nodes(self) -> list[str]:
        """The Ray node id of each rollout instance."""
        return [self.node_of(self._rollout_bundle(i)) for i in range(self.cfg.workflow.rollout_instances)]

    def megatron_nodes(self, group: str) -> list[str]:
        """The Ray node id of each rank of Megatron group ``group``."""
        mcfg = self.cfg.critic if group == "critic" else self.cfg.trainer
        return [self.node_of(self._megatron_bundle(group, r)) for r in range(world_size(mcfg))]

    def weight_routes(self) -> dict:
        """How weights travel (``asyncflow.bridge.routes``): ``relay`` (whether any pair crosses hosts),
        ``rollout_hosts`` (each rollout instance's host key) and ``lines`` (each pair's way and why).
        ``weight_sync.transport: shm`` with a trainer rank and a rollout instance on different nodes is an error."""
        from asyncflow.bridge import routes

        transport = self.cfg.weight_sync.transport
        trainer, rollout = self.megatron_nodes("actor"), self.rollout_nodes()
        if transport == "shm" and len(set(trainer) | set(rollout)) > 1:
            raise ConfigError("weight_sync.transport=shm needs the trainer and rollout on one node, but the "
                              f"placement spans {len(set(trainer) | set(rollout))} nodes: use auto (the default)")
        return {"relay": routes.needs_relay(transport, trainer, rollout),
                "rollout_hosts": [routes.host_key(transport, n, "rollout") for n in rollout],
                "lines": routes.describe(transport, trainer, rollout)}

    def _rollout_bundle(self, instance: int) -> int:
        if self.acc is None:
            return 0
        if self.colocated:
            return self.order["actor"][self.cfg.rollout.tensor_parallel * instance]
        return instance

    def _megatron_bundle(self, group: str, rank: int) -> int:
        if self.acc is None:
            return 0 if (self.colocated or group == "reference") else 1
        return self.order[group][rank]

    def rollout_devices(self, instance: int) -> list[str] | None:
        """Colocated ``sync`` on devices: the device ids of rollout engine ``instance`` (the trainer's devices
        it takes turns on), for its ``CUDA_VISIBLE_DEVICES``. None otherwise (Ray assigns them).

        Ray gives an actor that asks for a fraction of a device in a one-device bundle that device; a vLLM
        engine with TP > 1 needs TP of them, which no single bundle has, so each bundle's device id is looked
        up by a small task placed in it (done once, before any worker takes its share).
        """
        if self.acc is None or not self.colocated:
            return None
        if self._device_ids is None:
            import ray

            probe = ray.remote(_accelerator_ids)
            refs = [probe.options(**self._options(b, 0, 0.01)).remote(self.acc) for b in range(len(self.bundles))]
            self._device_ids = [ids[0] if ids else None for ids in ray.get(refs)]
        tp = self.cfg.rollout.tensor_parallel
        return [str(self._device_ids[b]) for b in self.order["actor"][instance * tp:(instance + 1) * tp]]

    def _options(self, bundle: int, cpus: float, devices: float = 0.0) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = {"num_cpus": cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle)}
        if devices:
            devices *= self.cfg.ray.device_fraction  # of a fractional bundle (``ray.device_fraction``)
            if self.acc == "GPU":
                opts["num_gpus"] = devices
            else:
                opts["resources"] = {self.acc: devices}
        return opts

    def spare_bundles(self) -> list[int]:
        """The rollout bundles of the warm spares (devices, ``async`` and ``stream``: those after the instances'; a
        spare that takes a dead instance's slot keeps its own, and the dead one's goes to the spare that refills
        the pool). Empty on the CPU layout: spares share rollout's core there."""
        if self.acc is None or self.colocated:
            return []
        n = self.cfg.workflow.rollout_instances
        return list(range(n, n + self.cfg.workflow.rollout_spares))

    def rollout_node(self, bundle: int) -> str:
        """The Ray node id of the rollout engine in ``bundle`` (``rollout``'s ``bundle``)."""
        return self.node_of(0 if self.acc is None else bundle)

    # ----------------------------------------------------------------- workers
    def rollout(self, instance: int, bundle: int | None = None) -> tuple[dict, list[int] | None]:
        """Options and pinned cores (CPU layout) of rollout engine ``instance`` (-1: a warm spare). ``bundle``: on
        devices, the rollout bundle it takes (default: ``instance``'s own; a spare's from ``spare_bundles``)."""
        if self.acc is None:
            cpus = list(range(self.cores)) if self.colocated else [0]
            return self._options(0, 1 if instance == 0 else 0), cpus
        if self.colocated:  # a share of the first of its devices; rollout_devices names all of them
            return self._options(self._rollout_bundle(instance), 1, self.fraction["rollout"]), None
        return self._options(instance if bundle is None else bundle, 1, self.cfg.rollout.tensor_parallel), None

    def light(self) -> dict:
        """Options of the light CPU tasks (reward, advantage): beside rollout 0 (CPU layout: the trainer side)."""
        if self.acc is None:
            return self._options(0 if self.colocated else 1, 0)
        return self._options(0, 0)

    def megatron(self, group: str, rank: int) -> tuple[dict, list[int] | None]:
        """Options and pinned cores of rank ``rank`` of Megatron group ``actor``, ``reference`` or ``critic``."""
        if self.acc is None:
            if group == "reference" and not self.colocated:
                # The reference forward shares rollout's core: the actor update is the longer task, and the
                # rollout side idles whenever it waits for weights, so the two cores stay evenly busy.
                return self._options(0, 0), [0]
            bundle = 0 if self.colocated else 1
            cpus = list(range(self.cores)) if self.colocated else list(range(1, self.cores))
            # Only the actor's rank 0 reserves a CPU: every rank of a group must be scheduled at once (they
            # rendezvous in their constructors) and a 2-core machine has no CPU to reserve per rank.
            return self._options(bundle, 1 if group == "actor" and rank == 0 else 0), cpus
        return self._options(self._megatron_bundle(group, rank), 0, self.fraction[group]), None

    def rendezvous(self, group: str) -> tuple[str, int]:
        """``(address, port)`` where rank 0 of ``group`` listens for the group's torch.distributed rendezvous.

        On devices both are looked up on rank 0's node by a zero-resource task in its bundle: a port free
        on the driver's host may be taken there.
        """
        import ray

        from asyncflow.ports import free_port

        if self.acc is None:
            return "127.0.0.1", free_port()  # one machine: never listen beyond it
        opts = self._options(self._megatron_bundle(group, 0), 0)
        return tuple(ray.get(ray.remote(_node_address_and_free_port).options(**opts).remote()))


def _address_key(address: str) -> tuple:
    """Sort key of a node address (numeric for IP addresses)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address)
        return (ip.version, int(ip), address)
    except ValueError:
        return (9, 0, address)


def _accelerator_ids(resource: str) -> list[str]:
    """The ids of the ``resource`` devices Ray assigned to this task."""
    import ray

    return list(ray.get_runtime_context().get_accelerator_ids().get(resource, []))


def _node_address_and_free_port() -> tuple[str, int]:
    """This node's IP as Ray knows it and a TCP port free on it (run as a task on the node in question)."""
    import ray

    from asyncflow.ports import free_port

    address = ray.util.get_node_ip_address()
    return address, free_port(address)
