"""Run failures whose message is the whole story: the CLI prints them without a traceback."""

from __future__ import annotations


class WeightApplyError(RuntimeError):
    """A rollout instance could not apply a weight version (the message names the instance and version)."""


class WorkerDiedError(RuntimeError):
    """A service's process died; the message names the worker group, the instance or rank, and for rollout the
    weight version it was applying."""


class TrainerDiedError(WorkerDiedError):
    """A trainer rank's process died (``group``: actor or critic, ``rank``); ``step``: the steps trained when the
    driver saw it. The driver restarts the run from its newest checkpoint (``workflow.max_restarts``)."""

    def __init__(self, message: str, group: str, rank: int, step: int | None = None):
        super().__init__(message)
        self.group, self.rank, self.step = group, rank, step


class NodePathError(RuntimeError):
    """A path the run needs (model, tokenizer, checkpoint root) is not visible on a node of the Ray cluster; the
    message names the node and the path."""
