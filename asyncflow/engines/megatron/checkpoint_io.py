"""Megatron distributed-checkpoint saving without forking.

Megatron's ``torch_dist`` save strategy writes every file from processes it *forks*
(``FileSystemWriterAsync.write_preloaded_data_multiproc``), even for a synchronous save. A Ray worker is
heavily multi-threaded (Ray's core worker, the TransferQueue client, torch's OpenMP pool, gloo), and a fork
of such a process may inherit a lock held by another thread, and the forked writer then waits forever
(a run's actor hangs in its save). ``InProcessSaveStrategy`` runs Megatron's own
per-file writer (``write_preloaded_data``) in the calling process instead, one file after another; the
plan, the files and the metadata are exactly Megatron's.

Checked against megatron-core 0.16.x (the version ``megatron_patches`` accepts); the loaders are unchanged.
"""

from __future__ import annotations

import functools
import queue

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def _write_in_process(transform_list: list, rank: int, write_buckets: list, results_queue) -> None:
    """``write_preloaded_data_multiproc`` without the worker processes: same writer, same results."""
    del rank  # only logged by Megatron
    local, count = queue.Queue(), queue.Queue()
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)  # the writer takes one token from it when done, as from its JoinableQueue
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, use_fsync=True)
        idx, out = local.get()
        if isinstance(out, Exception):
            results = out
            break
        results[idx] = out
    results_queue.put(results)


class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy, writing its files in the calling process (no fork)."""

    def __init__(self):
        super().__init__("torch_dist", 1, thread_count=1)

    def async_save(self, sharded_state_dict, checkpoint_dir):
        request = super().async_save(sharded_state_dict, checkpoint_dir)
        if request.async_fn is None:  # nothing to write on this rank
            return request
        fn = request.async_fn
        if not (isinstance(fn, functools.partial) and fn.func == FileSystemWriterAsync.write_preloaded_data_multiproc):
            raise RuntimeError(f"unexpected Megatron save function {fn!r}: this megatron-core version is not supported")
        transform_list = fn.args[0]
        return request._replace(async_fn=functools.partial(_write_in_process, transform_list))
