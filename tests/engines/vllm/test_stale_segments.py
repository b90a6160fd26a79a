"""A SIGKILLed vLLM engine process never shuts its engine down, so the segments its multi-process engine made stay
in /dev/shm (``rollout.in_process: false``, TP > 1); the engine lists them in a ledger, and the next engine that
starts or closes on the host removes those of dead processes (``remove_stale_segments``). Here real processes list
a real segment each and one is SIGKILLed; starting and killing vLLM itself is what the ledger's lines in
``VllmRollout`` add to this (a restarted instance runs them before it serves)."""

import os
import signal
import subprocess
import sys
import uuid

from asyncflow.engines.vllm import rollout

HOLDER = """
import mmap, os, sys, time
from asyncflow.engines.vllm import rollout
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(b"x" * 4096)
fd = os.open(path, os.O_RDWR)
held = mmap.mmap(fd, 4096)  # mapped, as a live engine's segments are
rollout._record_segments({path})
print("ready", flush=True)
time.sleep(600)
"""


def _holder(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_segments_of_a_killed_engine_process_are_removed_and_a_live_ones_kept():
    dead_path, live_path = (f"/dev/shm/psm_test_{uuid.uuid4().hex[:8]}" for _ in range(2))
    dead, live = _holder(dead_path), _holder(live_path)
    try:
        assert (rollout._LEDGERS / f"{dead.pid}.json").exists()
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(30)
        assert os.path.exists(dead_path)  # nobody unlinked it
        removed = rollout.remove_stale_segments()
        assert dead_path in removed and not os.path.exists(dead_path)
        assert not (rollout._LEDGERS / f"{dead.pid}.json").exists()
        assert os.path.exists(live_path) and (rollout._LEDGERS / f"{live.pid}.json").exists()  # its owner lives
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.wait(30)
    rollout.remove_stale_segments()  # the live one's, now that it is dead too
    assert not os.path.exists(live_path) and not (rollout._LEDGERS / f"{live.pid}.json").exists()


SEMAPHORE_MAKER = """
import multiprocessing as mp, time
lock = mp.get_context("spawn").Lock()  # a named semaphore, kept for a spawned child to open
print(lock._semlock.name, flush=True)
time.sleep(600)
"""


def test_another_processes_semaphore_is_neither_listed_nor_unlinked():
    """Two engines starting at once on one host: a semaphore another process made meanwhile is not this engine's
    (its creator maps it under a deleted temporary name; only the inode matches), so it is neither recorded in
    this engine's ledger nor unlinked by a sweep while its creator lives; once the creator is dead it goes."""
    maker = subprocess.Popen([sys.executable, "-c", SEMAPHORE_MAKER], stdout=subprocess.PIPE, text=True)
    try:
        path = "/dev/shm/sem." + maker.stdout.readline().strip().lstrip("/")
        assert os.path.exists(path)
        assert path not in rollout._mapped([maker.pid])[0]  # not by its name: the inode tells
        assert rollout._in(path, rollout._mapped([maker.pid]))
        assert not rollout._in(path, rollout._mapped([os.getpid()]))  # not this process's
        rollout._unlink_unused({path})
        assert os.path.exists(path)  # its creator still maps it
    finally:
        maker.kill()
        maker.wait(30)
    rollout._unlink_unused({path})
    assert not os.path.exists(path)
