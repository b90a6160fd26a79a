"""Run failures whose message is the whole story: the CLI prints them without a traceback."""

from __future__ import annotations


class WeightApplyError(RuntimeError):
    """A rollout instance could not apply a weight version (the message names the instance and version)."""


class WorkerDiedError(RuntimeError):
    """A service's process died; the message names the worker group, the instance or rank, and for rollout the
    weight version it was applying."""


class RunLostError(WorkerDiedError):
    """Something died whose loss only a restart of the whole run repairs: the driver restarts the run from its
    newest checkpoint (``workflow.max_restarts``). ``group`` and ``rank`` name what died; ``step``: the steps trained
    when the driver saw it."""

    kind = "run"
    """What died, in the restart's record (``cause`` in ``restarts.jsonl`` and the summary). Not named ``cause``:
    the CLI and the loop read ``cause`` as a Ray task error's own exception."""

    def __init__(self, message: str, group: str, rank: int | None, step: int | None = None):
        super().__init__(message)
        self.group, self.rank, self.step = group, rank, step

    def who(self) -> str:
        """What died, for the restart's line."""
        return f"{self.group} {self.rank}"


class TrainerDiedError(RunLostError):
    """A trainer rank's process died (``group``: actor, critic or reference, ``rank``)."""

    kind = "trainer"

    def who(self) -> str:
        return f"trainer rank {self.rank} ({self.group})"


class ServiceLostError(RunLostError):
    """A service worker that is not restarted in place died (``group``: rollout, reward, advantage, ...; ``rank``:
    its instance or worker index): in ``sync`` mode, a group outside ``supervisor.restartable``, or past
    ``workflow.max_service_restarts``. With checkpoints on the run restarts from its newest one; without, it stops
    with this message."""

    kind = "service"

    def who(self) -> str:
        return f"rollout instance {self.rank}" if self.group == "rollout" else f"{self.group} worker {self.rank}"


class StorageLostError(RunLostError):
    """TransferQueue rows the run still needed were lost: a storage unit died with them (``group`` "storage",
    ``rank``: the unit's id, None when the controller could not say), or the controller did (``group``
    "controller")."""

    kind = "storage"

    def who(self) -> str:
        if self.group == "controller":
            return "the TransferQueue controller"
        return "a TransferQueue storage unit" if self.rank is None else f"TransferQueue storage unit {self.rank}"


class NodePathError(RuntimeError):
    """A path the run needs (model, tokenizer, checkpoint root) is not visible on a node of the Ray cluster; the
    message names the node and the path."""


class ClusterUnreachableError(RuntimeError):
    """Nothing answers at ``ray.address``: the cluster's head (its GCS) is down or the address is wrong. Ray's own
    client would wait for it without a bound; the message names the address and what to check."""
