"""Starting a TransferQueue on one machine: servers on threads (tests, debugging) or as processes.

``start(config)`` is the single entry point; it dispatches to Ray (``ray_deploy``) when
``config.deployment == "ray"``. Every deployment knows what it started and stops exactly that:
``shutdown`` terminates its own processes (never others by name) and removes its shared memory.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, replace

from .config import TransferQueueConfig
from .deployment import PACKAGE_ROOT, Deployment, wait_ready
from .errors import ServerUnavailableError
from .shm import new_shm_prefix, remove_leftovers, remove_stale, unlink_quietly

_START_TIMEOUT_S = 120.0  # interpreter start-up on a heavily loaded machine can take tens of seconds


class ThreadDeployment(Deployment):
    """Controller and storage units on daemon threads of this process."""

    def __init__(self, config: TransferQueueConfig):
        from .controller import Controller
        from .storage import StorageUnit

        self.config = config
        remove_stale()  # arenas of crashed runs on this host
        self.shm_prefix = new_shm_prefix()
        # Also at interpreter exit without shutdown(): shared memory outlives processes otherwise.
        self._finalizer = weakref.finalize(self, remove_leftovers, self.shm_prefix)
        self.controller = Controller(config)
        self.address = self.controller.address
        self.units = []
        self._threads = [threading.Thread(target=self.controller.serve_forever, name="tq-controller",
                                          daemon=True)]
        try:
            for i in range(config.num_storage_units):
                unit = StorageUnit(i, config, self.address, self.shm_prefix)
                self.units.append(unit)
                self._threads.append(threading.Thread(target=unit.serve_forever, name=f"tq-unit{i}",
                                                      daemon=True))
            for t in self._threads:
                t.start()
            wait_ready(self.address, config)
        except BaseException:
            self.shutdown()  # never leave threads or shared memory behind a failed start
            raise

    def stop_unit(self, index: int) -> None:
        """Stop one storage unit (tests of failure handling)."""
        self.units[index].stop()
        self._threads[index + 1].join(5)

    def shutdown(self) -> None:
        for server in (*self.units, self.controller):
            server.stop()
        for t in self._threads:
            if t.is_alive():
                t.join(5)
            elif t.ident is None:  # never started: its server still owns sockets and an arena
                server = self.controller if t is self._threads[0] else self.units[self._threads.index(t) - 1]
                for callback in server.server.on_close:
                    callback()
                server.server.sock.close(linger=0)
                server.server.ctx.term()
                if hasattr(server, "arena"):
                    server.arena.close()
        remove_leftovers(self.shm_prefix)


class ProcessDeployment(Deployment):
    """Controller and storage units as child processes of this one."""

    def __init__(self, config: TransferQueueConfig):
        self.config = config
        remove_stale()  # arenas of crashed runs on this host
        self.shm_prefix = new_shm_prefix()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self._env = env
        self.procs: list[subprocess.Popen] = []
        self._restarts = 0
        self._finalizer = weakref.finalize(self, _terminate, self.procs, self.shm_prefix)
        try:
            # All processes start at once (interpreter start-up dominates); units learn the
            # controller's address on stdin as soon as the controller prints it.
            ctrl = self._spawn({"role": "controller"}, stdout=subprocess.PIPE)
            units = [self._spawn({"role": "unit", "unit": i, "shm_prefix": self.shm_prefix}, keep_stdin=True)
                     for i in range(config.num_storage_units)]
            line = _read_line(ctrl, max(config.rpc_timeout_s, _START_TIMEOUT_S))
            if not line.startswith("tcp://"):
                raise ServerUnavailableError(f"controller did not start within "
                                             f"{max(config.rpc_timeout_s, _START_TIMEOUT_S):g} s "
                                             f"(exit code {ctrl.poll()})")
            self.address = line
            for unit in units:
                unit.stdin.write((line + "\n").encode())
                unit.stdin.close()
            wait_ready(self.address, config, self.procs)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, spec: dict, stdout=None, keep_stdin: bool = False) -> subprocess.Popen:
        # The config (with the secret) goes through stdin, never the command line.
        proc = subprocess.Popen([sys.executable, "-m", "asyncflow.transfer_queue._server"],
                                stdin=subprocess.PIPE, stdout=stdout, env=self._env)
        self.procs.append(proc)
        proc.stdin.write((json.dumps({**spec, "config": asdict(self.config)}) + "\n").encode())
        proc.stdin.flush()
        if not keep_stdin:
            proc.stdin.close()
        return proc

    @property
    def unit_pids(self) -> list[int]:
        return [p.pid for p in self.procs[1:]]

    def kill_unit(self, index: int) -> None:
        """SIGKILL one storage unit (tests of failure handling)."""
        self.procs[index + 1].kill()
        self.procs[index + 1].wait()

    def restart_unit(self, index: int) -> None:
        """Start a new process for storage unit ``index`` after its old one died. It gets a fresh arena
        (the old one's rows are lost) and registers as a new incarnation; clients reconnect by
        themselves when a reply names it."""
        old = self.procs[index + 1]
        if old.poll() is None:
            raise RuntimeError(f"storage unit {index} is still running")
        self._restarts += 1
        # The dead process could not remove its arena; clients that still map it keep the memory until
        # they learn of the new incarnation and unmap it.
        unlink_quietly(f"{self.shm_prefix}-unit{index}")
        proc = self._spawn({"role": "unit", "unit": index, "controller": self.address,
                            "shm_prefix": f"{self.shm_prefix}-r{self._restarts}"})
        self.procs.remove(proc)  # _spawn appends; keep the unit at its index
        self.procs[index + 1] = proc

    def shutdown(self) -> None:
        self._finalizer()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line a child prints, or "" when it prints none within ``timeout_s`` (a controller
    stuck in start-up must fail the deployment, not hang it)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().decode().strip() if ready else ""


def _terminate(procs: list[subprocess.Popen], shm_prefix: str) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for stream in (p.stdout, p.stdin):
            if stream is not None and not stream.closed:
                stream.close()
    remove_leftovers(shm_prefix)


def start(config: TransferQueueConfig | None = None, **overrides) -> Deployment:
    """Start a TransferQueue as ``config.deployment`` says ("threads", "processes" or "ray").

    Without ``config.secret`` the processes and Ray deployments generate one; pass
    ``deployment.config`` (not the config you started with) to clients in other processes."""
    config = replace(config or TransferQueueConfig(), **overrides)
    if config.secret is None and config.deployment != "threads":
        # Other local users could otherwise read, write or clear rows over loopback TCP. Clients get
        # the secret through the deployment's config (``Deployment.client()``, ``deployment.config``).
        config = replace(config, secret=secrets.token_hex(32))
    config.validate()
    if config.deployment == "threads":
        return ThreadDeployment(config)
    if config.deployment == "processes":
        return ProcessDeployment(config)
    from .ray_deploy import RayDeployment

    return RayDeployment(config)
