"""Run failures whose message is the whole story: the CLI prints them without a traceback."""

from __future__ import annotations


class WeightApplyError(RuntimeError):
    """A rollout instance could not apply a weight version (the message names the instance and version)."""


class WorkerDiedError(RuntimeError):
    """A service's process died; the message names the worker group, the instance or rank, and for rollout the
    weight version it was applying."""


class NodePathError(RuntimeError):
    """A path the run needs (model, tokenizer, checkpoint root) is not visible on a node of the Ray cluster; the
    message names the node and the path."""
