"""TransferQueue: the streaming, sample-level data plane between AsyncFlow's RL tasks.

Quick start::

    from asyncflow.transfer_queue import TransferQueueConfig, start

    with start(TransferQueueConfig(deployment="processes")) as tq:
        client = tq.client()
        client.create_partition("step0")
        client.put("step0", {"prompts": prompt_ids}, group_ids=gids)
        batch = client.get("step0", task="rollout", fields=["prompts"], batch_size=8)

Exports are resolved lazily so that server processes, which import submodules of this package, do
not pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TransferQueueConfig": "config",
    "TransferQueueClient": "client",
    "AsyncTransferQueueClient": "async_client",
    "Batch": "batch",
    "BatchMeta": "batch",
    "Packed": "codec",
    "start": "deploy",
    "Deployment": "deployment",
    "Controller": "controller",
    "StorageUnit": "storage",
    "Sampler": "samplers",
    "SAMPLERS": "samplers",
    "register_sampler": "samplers",
    "TransferQueueError": "errors",
    "BadRequestError": "errors",
    "AlreadyWrittenError": "errors",
    "WritePendingError": "errors",
    "RowsClearedError": "errors",
    "UnknownPartitionError": "errors",
    "TransferQueueTimeoutError": "errors",
    "BackPressureError": "errors",
    "StorageUnitError": "errors",
    "StalePutError": "errors",
    "ReadCancelledError": "errors",
    "ServerUnavailableError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
