"""Fork servers for the Ray workers of the tests: the shared Ray's (``tests.recipe_runs.SharedRay``), and the real-stack
runs'.

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

Two kinds: the shared Ray's server (torch, transformers, the services and the fake engines) and the real-stack
server (also Megatron-core, the engines and as much of vLLM as imports no Ray), for the tests' ``asyncflow``
subprocesses run as ``python -m tests.zygote.launch`` (``launch_command``). The two-host cluster of the cross-host
tests (``tests/cluster/conftest.py``) runs ``ray start`` through ``ray_start.py`` on both hosts: host A's node forks
from this process's real-stack server, host B's from one that host B starts in its own namespaces
(``HostBServer``). Runs that tests watch process by process and every user run start their workers the normal way.
``ASYNCFLOW_TEST_ZYGOTE=0`` turns all of them off.
"""

from __future__ import annotations

import contextlib
import os
import shlex
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


@contextlib.contextmanager
def forked_workers():
    """Within: a Ray started in this process runs its workers through ``client.py`` (``ray.init`` takes no worker
    path, so the node's parameters are set as they are made)."""
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


def server_command(socket_path: Path, real: bool) -> list[str]:
    """The command that runs a fork server of that kind on ``socket_path`` (from the repository's folder)."""
    return [sys.executable, "-m", "tests.zygote.server", str(socket_path), *(["--real"] if real else [])]


def _forks(socket_path: Path) -> int:
    """How many workers the server of ``socket_path`` has forked so far (``server.py`` counts them beside it)."""
    try:
        return int(socket_path.with_suffix(".forks").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


class ForkServer:
    """One fork server of this process: the fake-engine kind (``real=False``: the shared Ray's), or the real-stack
    kind, which also imports Megatron-core and vLLM (as far as vLLM goes without importing Ray) for the
    ``asyncflow train`` subprocesses of the real-stack runs (``tests.recipe_runs.train(forked=True)``)."""

    def __init__(self, real: bool = False):
        self.real = real
        self.proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        light = Path(os.environ[ENV])
        return light.with_name("real.sock") if self.real else light

    def start(self) -> None:
        """Start the server (the clients wait for its socket: its imports overlap Ray's start)."""
        if not enabled() or (self.proc is not None and self.proc.poll() is None):
            return
        folder = self.socket_path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self.proc = subprocess.Popen(server_command(self.socket_path, self.real), cwd=REPO, stdin=subprocess.DEVNULL)

    def worker_command(self):
        """Within: a Ray started in this process runs its workers through ``client.py``."""
        return forked_workers()

    def forks(self) -> int:
        """How many workers the server has forked so far (it counts them in a file beside its socket)."""
        return _forks(self.socket_path)

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
            self.socket_path.unlink(missing_ok=True)
            self.socket_path.with_suffix(".forks").unlink(missing_ok=True)
            self.socket_path.with_suffix(".python").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the other kind's files may still be there
                self.socket_path.parent.rmdir()


_SERVERS: dict[bool, ForkServer] = {}


def session_server(real: bool = False) -> ForkServer:
    """This process's fork server of that kind, started on first use; ``stop_session_servers`` ends them."""
    server = _SERVERS.setdefault(real, ForkServer(real))
    server.start()
    return server


def launch_command() -> list[str]:
    """The command that runs ``asyncflow`` (its arguments follow) forked from this process's real-stack fork server,
    started here if it is not yet, with its Ray's workers forked from that server too; ``python -m asyncflow.cli``
    where the server is off. The command is ``client.py``, which passes signals on and exits with the driver's
    status; the driver is the server's child, so it is not for a test that looks for the run's processes among
    the command's descendants or in its session."""
    if not enabled():
        return [sys.executable, "-m", "asyncflow.cli"]
    return ["env", f"{ENV}={session_server(real=True).socket_path}", sys.executable, str(CLIENT), "--script",
            str(Path(__file__).with_name("launch.py"))]


def forked_script(script: Path, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """Run ``python SCRIPT ARGS`` as a child of this process's real-stack fork server (Megatron-core, torch and vLLM
    already imported), through ``client.py``: the ``Popen`` is the client, which passes signals on and exits with
    the child's status. A plain ``python SCRIPT`` where the servers are off. For the tests' own multi-process
    ranks that would each import vLLM again."""
    env = dict(os.environ if env is None else env)
    if not enabled():  # the script may import the tests' own modules, as the server's child can
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return subprocess.Popen([sys.executable, str(script), *args], env=env, **popen)
    env.update({ENV: str(session_server(real=True).socket_path), f"{ENV}_WORKER": str(script)})
    return subprocess.Popen([sys.executable, str(CLIENT), *args], env=env, **popen)


@contextlib.contextmanager
def spawned_from_server():
    """Within: the processes this process starts with ``multiprocessing``'s ``spawn`` (the checkpoint converter's
    ranks, a process pool) are forked from this process's real-stack fork server, through ``client.py --python``,
    instead of importing torch, Megatron-core and vLLM again; each is still a process of its own, as a spawned one
    is. Plain ``spawn`` where the servers are off."""
    if not enabled():
        yield
        return
    import multiprocessing
    import multiprocessing.spawn

    from tests.zygote.server import write_shim

    server = session_server(real=True)
    previous = multiprocessing.spawn.get_executable()
    multiprocessing.set_executable(write_shim(str(server.socket_path)))  # the client waits for the server's socket
    try:
        yield
    finally:
        multiprocessing.set_executable(previous)


class HostBServer:
    """The real-stack fork server of host B of a two-host cluster (``tools/two_host.py``): started by host B itself,
    in its namespaces, so that the workers it forks have host B's network, hostname and /dev/shm. Its socket is in
    this process's server folder (a filesystem socket: host B shares host A's /tmp)."""

    def __init__(self):
        self.socket_path = Path(os.environ[ENV]).with_name("host-b.sock")

    def shell_command(self) -> str:
        """What host B runs in the background before its Ray node starts (``two_host.up(before_b=...)``)."""
        return (f"rm -f {shlex.quote(str(self.socket_path))} && cd {shlex.quote(str(REPO))} && "
                f"exec {shlex.join(server_command(self.socket_path, real=True))}")

    def forks(self) -> int:
        """How many workers it has forked so far."""
        return _forks(self.socket_path)

    def remove_files(self) -> None:
        """Its socket and counter (after the cluster's ``down``, which stops it with host B's other processes)."""
        for path in (self.socket_path, self.socket_path.with_suffix(".forks"), self.socket_path.with_suffix(".python")):
            path.unlink(missing_ok=True)


def two_host_options(host_b: HostBServer) -> dict:
    """Options of ``two_host.up`` under which both hosts' Ray nodes fork their workers: host A's from this
    process's real-stack server, host B's from ``host_b`` (only where the servers are on: ``enabled``)."""
    worker = {f"{ENV}_WORKER": os.environ[f"{ENV}_WORKER"]}
    return {"ray_cli": [sys.executable, str(Path(__file__).with_name("ray_start.py"))],
            "env_a": {ENV: str(session_server(real=True).socket_path), **worker},
            "env_b": {ENV: str(host_b.socket_path), **worker}, "before_b": host_b.shell_command()}


def host_a_options() -> dict:
    """Options of ``two_host.up`` under which host A's Ray node forks its workers from this process's fake-engine
    server and host B's start theirs the normal way (a server on host A cannot fork a process into host B's
    namespaces); empty where the servers are off."""
    if not enabled():
        return {}
    return {"ray_cli": [sys.executable, str(Path(__file__).with_name("ray_start.py"))],
            "env_a": {ENV: str(session_server().socket_path), f"{ENV}_WORKER": os.environ[f"{ENV}_WORKER"]},
            "env_b": {ENV: "0"}}


def stop_session_servers() -> None:
    """Stop this process's fork servers (the session's end, after the shared Ray)."""
    for server in _SERVERS.values():
        server.stop()
    _SERVERS.clear()
