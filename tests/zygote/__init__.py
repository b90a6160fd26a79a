"""A fork server for the Ray workers of the tests' shared Ray (``tests.recipe_runs.SharedRay``).

On the 2-core test machine a run on the fake engines cost about 10 CPU-seconds, 7 of them its Ray actors starting:
each is a new Python process that imports torch, transformers and the service modules (about 1.2 s) before its
first call. The server (``server.py``) imports them once. The raylet's worker command runs ``client.py`` in place
of Ray's ``default_worker.py``; the client asks the server to fork a child that runs ``default_worker.py`` with the
client's arguments, environment, working directory and standard streams, and the child is from then on an ordinary
Ray worker (Ray itself is imported after the fork: its core reads the worker's environment when it loads). A run's
CPU halves; what is left per worker is Ray's own start (about 0.5 s).

The client stays alive as the process the raylet started: the child exits when the client dies (the raylet killing
its worker process), the client exits with the child's status (a test or Ray killing the worker by the pid that
``os.getpid()`` in the actor reports), and signals sent to the client go to the child.

Only the in-process fake-engine runs on the shared Ray use it: runs started as ``asyncflow train`` subprocesses,
the real-stack runs and every user run start their workers the normal way. ``ASYNCFLOW_TEST_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("client.py")
ENV = "ASYNCFLOW_TEST_ZYGOTE"


def enabled() -> bool:
    """Whether the shared Ray starts its workers through the fork server."""
    return os.environ.get(ENV) != "0"


def configure_environment() -> None:
    """Name this process's server socket and Ray's worker script in the environment the raylet will inherit. Call
    before any Ray thread exists in this process (tests/conftest.py does): a setenv while one reads the
    environment can crash it."""
    if not enabled():
        return
    import importlib.util

    ray_dir = Path(importlib.util.find_spec("ray").origin).parent
    os.environ[ENV] = str(Path(tempfile.gettempdir()) / f"afzygote-{os.getpid()}" / "server.sock")
    os.environ[f"{ENV}_WORKER"] = str(ray_dir / "_private" / "workers" / "default_worker.py")


class ForkServer:
    """This process's fork server: started once, before the shared Ray; stopped after it."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        return Path(os.environ[ENV])

    def start(self) -> None:
        """Start the server (the clients wait for its socket: its imports overlap Ray's start)."""
        if not enabled() or (self.proc is not None and self.proc.poll() is None):
            return
        folder = self.socket_path.parent
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700, parents=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote.server", str(self.socket_path)], cwd=REPO,
                                     stdin=subprocess.DEVNULL)

    @contextlib.contextmanager
    def worker_command(self):
        """Within: a Ray started in this process runs its workers through ``client.py`` (``ray.init`` takes no
        worker path, so the node's parameters are set as they are made)."""
        if not enabled():
            yield
            return
        from ray._private import parameter

        original = parameter.RayParams.__init__

        def init(params, *args, **kwargs):
            original(params, *args, **kwargs)
            params.worker_path = str(CLIENT)

        parameter.RayParams.__init__ = init
        try:
            yield
        finally:
            parameter.RayParams.__init__ = original

    def stop(self) -> None:
        """Stop the server (after the Ray whose workers it forked: a worker's client that loses the server exits)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if enabled():
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)
