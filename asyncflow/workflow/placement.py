"""Where every worker runs: one Ray placement group, and the bundle and resources of each worker.

Two layouts:

- CPU (``ray.accelerator: null``, the tiny recipes): ``async`` gives rollout one core and the trainer side
  the others, pinned so side-by-side workers stay off each other's cores; ``sync`` (colocated) puts every
  worker in one bundle of all cores, taking turns.
- Devices (``ray.accelerator: GPU``, or ``NPU`` and other custom Ray resources): one bundle per trainer
  rank (one device each) and one per rollout engine (``rollout.tensor_parallel`` devices, one node). The
  reference and, when its parallel sizes match the actor's, the critic share the actor's devices
  (fractions of each device: the three Megatron groups take turns on them); a critic of another shape
  gets devices of its own. The ``PACK`` strategy keeps consecutive ranks (a tensor-parallel group) on
  one node; the recipe checker makes sure TP fits a node. Megatron groups rendezvous at the node of their
  rank 0, so a group may span nodes. Not run on real devices here (no GPU on the CI machines); the
  layout is tested on a local Ray cluster that declares devices it does not have.
"""

from __future__ import annotations

from asyncflow.config import AsyncFlowConfig, MegatronConfig


def world_size(mcfg: MegatronConfig) -> int:
    """Ranks of a Megatron group: TP x PP x DP."""
    return mcfg.tensor_parallel * mcfg.pipeline_parallel * mcfg.data_parallel


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
        self.pg = placement_group(bundles, strategy="PACK")
        ray.get(self.pg.ready(), timeout=cfg.ray.placement_timeout_s)

    # ----------------------------------------------------------------- device layout
    def _device_bundles(self, critic: bool, reference: bool) -> list[dict]:
        cfg, cpd = self.cfg, self.cfg.ray.cpus_per_device
        rollout = [{self.acc: cfg.rollout.tensor_parallel, "CPU": cpd}] * cfg.workflow.rollout_instances
        trainer = [{self.acc: 1, "CPU": cpd}] * world_size(cfg.trainer)
        self.first = {"rollout": 0, "actor": len(rollout), "reference": len(rollout)}
        sharers = ["actor"] + (["reference"] if reference else [])
        own_critic = critic and world_size(cfg.critic) != world_size(cfg.trainer)
        if critic and not own_critic:
            sharers.append("critic")
            self.first["critic"] = len(rollout)
        elif own_critic:
            self.first["critic"] = len(rollout) + len(trainer)
        self.fraction = {name: 1.0 / len(sharers) for name in sharers}
        self.fraction["critic"] = self.fraction.get("critic", 1.0)
        critic_bundles = [{self.acc: 1, "CPU": cpd}] * (world_size(cfg.critic) if own_critic else 0)
        return rollout + trainer + critic_bundles

    def _options(self, bundle: int, cpus: float, devices: float = 0.0) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = {"num_cpus": cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle)}
        if devices:
            if self.acc == "GPU":
                opts["num_gpus"] = devices
            else:
                opts["resources"] = {self.acc: devices}
        return opts

    # ----------------------------------------------------------------- workers
    def rollout(self, instance: int) -> tuple[dict, list[int] | None]:
        """Options and pinned cores (CPU layout) of rollout engine ``instance``."""
        if self.acc is None:
            cpus = list(range(self.cores)) if self.colocated else [0]
            return self._options(0, 1 if instance == 0 else 0), cpus
        return self._options(instance, 1, self.cfg.rollout.tensor_parallel), None

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
                # rollout side idles whenever it waits for weights (measured: it balances the two cores).
                return self._options(0, 0), [0]
            bundle = 0 if self.colocated else 1
            cpus = list(range(self.cores)) if self.colocated else list(range(1, self.cores))
            # Only the actor's rank 0 reserves a CPU: every rank of a group must be scheduled at once (they
            # rendezvous in their constructors) and a 2-core machine has no CPU to reserve per rank.
            return self._options(bundle, 1 if group == "actor" and rank == 0 else 0), cpus
        return self._options(self.first[group] + rank, 0, self.fraction[group]), None

    def rendezvous(self, group: str) -> tuple[str, int]:
        """``(address, port)`` where rank 0 of ``group`` listens for the group's torch.distributed rendezvous.

        On devices both are looked up on rank 0's node by a zero-resource task in its bundle: a port free
        on the driver's host may be taken there.
        """
        import ray

        from asyncflow.models.parallel import free_port

        if self.acc is None:
            return "127.0.0.1", free_port()  # one machine: never listen beyond it
        opts = self._options(self.first[group], 0)
        return tuple(ray.get(ray.remote(_node_address_and_free_port).options(**opts).remote()))


def _node_address_and_free_port() -> tuple[str, int]:
    """This node's IP as Ray knows it and a TCP port free on it (run as a task on the node in question)."""
    import ray

    from asyncflow.models.parallel import free_port

    address = ray.util.get_node_ip_address()
    return address, free_port(address)
