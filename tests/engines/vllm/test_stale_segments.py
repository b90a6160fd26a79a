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
from pathlib import Path

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


IPC_HOLDER = """
import os, sys, time
import zmq
from asyncflow.engines.vllm import rollout
rollout._environment(rollout.VllmConfig(), None, None)
from vllm.utils.network_utils import get_open_zmq_ipc_path  # where vLLM puts its message queues and engine sockets
sock = zmq.Context().socket(zmq.PUB)
sock.bind(get_open_zmq_ipc_path())
print(sock.getsockopt_string(zmq.LAST_ENDPOINT)[len("ipc://"):], flush=True)
time.sleep(600)
"""


def test_the_ipc_sockets_of_a_killed_engine_process_are_removed_and_a_live_ones_kept():
    """vLLM's ``ipc://`` sockets go to a directory of the engine process's own (``VLLM_RPC_BASE_PATH``), not to /tmp:
    a SIGKILLed process's socket file stays there until a sweep (``remove_stale_ipc``) removes the directory; a live
    process's is kept. A process that inherited another engine process's directory takes one of its own."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), VLLM_RPC_BASE_PATH=str(rollout.ipc_dir()))  # this one's, inherited
    procs = [subprocess.Popen([sys.executable, "-c", IPC_HOLDER], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    try:
        dead_socket, live_socket = (Path(proc.stdout.readline().strip()) for proc in procs)
        for proc, socket in zip(procs, (dead_socket, live_socket)):
            assert socket.is_socket() and socket.parent.parent == rollout._IPC, socket
            assert socket.parent.name.startswith(f"{proc.pid}-")  # its own directory, not the inherited one
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(30)
        assert dead_socket.is_socket()  # nobody closed it
        removed = rollout.remove_stale_ipc()
        assert dead_socket.parent in removed and not dead_socket.parent.exists()
        assert live_socket.is_socket()  # its owner lives
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
    rollout.remove_stale_ipc()
    assert not live_socket.parent.exists()


def test_a_base_path_too_long_for_a_socket_is_not_set(monkeypatch, tmp_path):
    """Under a long temporary directory a socket's path (the base, ``/``, a uuid) would pass the 107 bytes of
    ``sun_path``: vLLM is left its own default there; under a short one the engine process's own folder is set."""
    from asyncflow.config import VllmConfig

    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(rollout, "_IPC", tmp_path / ("x" * 80))
    rollout._environment(VllmConfig(), None, None)
    assert "VLLM_RPC_BASE_PATH" not in env
    short = Path("/tmp") / f"afipc-test-{os.getpid()}"
    monkeypatch.setattr(rollout, "_IPC", short)
    try:
        rollout._environment(VllmConfig(), None, None)
        assert Path(env["VLLM_RPC_BASE_PATH"]).parent == short
        assert len(env["VLLM_RPC_BASE_PATH"]) + len(f"/{uuid.uuid4()}") <= 107
    finally:
        import shutil

        shutil.rmtree(short, ignore_errors=True)
