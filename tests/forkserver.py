"""The start method of the tests' multi-process Megatron runs (``torch.multiprocessing.start_processes``, process
pools): Python's ``forkserver``, whose server imports torch and Megatron-core once per pytest process, where
``spawn`` had each of a test's ranks import them again (about 3 CPU-seconds a process on the 2-core machine). The
children are still fresh processes next to pytest's (forked from the server, not from pytest), so Megatron's
process groups and patches never reach pytest. ``ASYNCFLOW_TEST_FORKSERVER=0`` goes back to ``spawn``.

The server is started once and keeps the environment of that moment: a child sees what the test passes it, not a
variable the test set in its own environment later.
"""

import multiprocessing
import os

PRELOAD = ["torch", "megatron.core", "asyncflow.engines.megatron.trainer", "asyncflow.engines.megatron.actor",
           "asyncflow.engines.megatron.critic"]


def start_method() -> str:
    """``forkserver`` (its server preloading ``PRELOAD``), or ``spawn`` where turned off."""
    if os.environ.get("ASYNCFLOW_TEST_FORKSERVER") == "0":
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # only read when the server starts
    return "forkserver"
