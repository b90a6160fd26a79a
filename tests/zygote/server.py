"""The fork server behind ``tests.zygote.ForkServer``: import what a worker of a fake-engine run needs (with
``--real``: of a real-stack run too), then fork one child per request from ``tests/zygote/client.py`` and report how
each child ended.

    python -m tests.zygote.server SOCKET_PATH [--real]
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import importlib
import importlib.abc
import json
import os
import runpy
import selectors
import shlex
import signal
import socket
import struct
import sys
import threading
import warnings

PRELOAD = ("torch", "transformers", "asyncflow.workflow.workers", "asyncflow.engines.fake",
           "asyncflow.transfer_queue.client", "asyncflow.models.tokenizer", "asyncflow.rewards",
           "asyncflow.algorithms.advantages")
"""What a worker of a fake-engine run imports (a module not here is imported by the child, as by a worker started
the normal way). Not Ray: its C++ core reads the environment when it loads (the job id, the auth mode), and a
worker's environment is only known at the fork."""
REAL_PRELOAD = ("megatron.core", "asyncflow.engines.megatron.actor", "asyncflow.engines.megatron.critic",
                "asyncflow.engines.vllm.rollout")
"""What a worker of a real-stack run imports besides (vLLM's own modules are found by ``_ray_free_modules``)."""
HEADER = struct.Struct("!I")
MAX_FDS = 64  # descriptors a request may pass: the standard streams and a spawn's own
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "client.py")


def write_shim(socket_path: str) -> str:
    """The interpreter the server's children spawn through (``multiprocessing.set_executable``): a script beside the
    socket that runs ``client.py --python``, so that a spawned process (vLLM's tensor-parallel workers, a
    multiprocessing forkserver) is forked from this server too instead of importing torch and vLLM again."""
    shim = socket_path.rsplit(".", 1)[0] + ".python"
    partial = f"{shim}.{os.getpid()}"
    with open(partial, "w") as f:
        f.write(f"#!/bin/sh\nexport ASYNCFLOW_TEST_ZYGOTE={shlex.quote(socket_path)}\n"  # this server's, whoever spawns
                f"exec {shlex.quote(sys.executable)} {shlex.quote(CLIENT)} --python \"$@\"\n")
    os.chmod(partial, 0o755)
    os.replace(partial, shim)  # whole or not there: the server and the tests' process both write it
    return shim


def _preload(real: bool) -> None:
    # Megatron's "Transformer Engine and Apex are not installed" is not the server's to print.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD + (REAL_PRELOAD if real else ()):
            importlib.import_module(name)
        import transformers

        transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast  # noqa: B018 - resolve the lazy imports
        if real:
            for name in _ray_free_modules("from vllm import LLM, SamplingParams"):
                importlib.import_module(name)
                if "ray" in sys.modules:
                    raise RuntimeError(f"preloading {name} imported ray, which the server must not")


class _Completed(importlib.abc.MetaPathFinder):
    """Records the modules whose import completed before the first import of Ray."""

    def __init__(self):
        self.names: list[str] = []
        self.ray_seen = False

    def find_spec(self, name, path, target=None):
        if self.ray_seen or name == "ray" or name.startswith("ray."):
            self.ray_seen = True
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = getattr(spec.loader, "exec_module", None)
        if run is not None:
            def exec_module(module, run=run, name=name):
                run(module)
                if not self.ray_seen:
                    self.names.append(name)

            spec.loader.exec_module = exec_module
        return spec


def _ray_free_modules(statement: str) -> list[str]:
    """The modules that ``statement`` imports, in the order their imports complete, up to its first import of Ray:
    each one's own imports completed before it, so importing them in this order imports no Ray. vLLM imports Ray
    deep inside ``from vllm import LLM``. Found in a forked child, which imports Ray and is then thrown away."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        names = []
        try:
            tracer = _Completed()
            sys.meta_path.insert(0, tracer)
            exec(statement, {})  # noqa: S102 - a fixed statement of this module
            names = tracer.names
        finally:
            with os.fdopen(write, "w") as out:
                json.dump(names, out)
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as result:
        names = json.load(result)
    os.waitpid(pid, 0)
    return names


def _die_with_parent() -> None:
    """The server lives as long as the pytest process that started it, even one that is killed (the TransferQueue's
    servers do the same)."""
    from asyncflow.transfer_queue._server import _die_with_parent as sigterm_when_parent_dies

    sigterm_when_parent_dies()
    if os.getppid() == 1:  # the parent died before the signal was set
        sys.exit(0)


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a length-prefixed JSON object, the client's three standard streams and the descriptors it
    passes on (a spawn's)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, MAX_FDS)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("the client closed before its request was complete")
        data += more
    (size,) = HEADER.unpack_from(data)
    return json.loads(data[HEADER.size:HEADER.size + size]), list(fds)


def _watch_client(conn: socket.socket) -> None:
    """In the child: end as a killed worker would once the client (the process the raylet started) is gone."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os._exit(137)


def _high(fd: int) -> int:
    """``fd`` moved to a number of 1024 or more (closed where it was)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024)
    os.close(fd)
    return moved


def _place(conn: socket.socket, fds: list[int], targets: list[int]) -> socket.socket:
    """Put the received descriptors at the client's numbers, first moving them and the client's connection out of
    the way (one may sit on another's number, or on the connection's); returns the connection."""
    conn = socket.socket(fileno=_high(conn.detach()))
    for fd, target in zip([_high(fd) for fd in fds], targets):
        os.dup2(fd, target)  # inheritable, as in the client
        os.close(fd)
    return conn


def _become_worker(conn: socket.socket, request: dict, fds: list[int], shim: str) -> int:
    """Run ``default_worker.py`` (or a spawn's ``-c`` code) as the client would have run it; its exit code."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    conn = _place(conn, fds, [0, 1, 2, *request.get("fds", [])])
    import multiprocessing

    multiprocessing.set_executable(shim)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import numpy as np

    np.random.seed()  # as a fresh process would be (Python's own random reseeds itself at a fork)
    argv = request["argv"]
    sys.argv = list(argv)
    code = request.get("code")
    sys.path[0] = "" if code is not None else os.path.dirname(os.path.abspath(argv[0]))
    threading.Thread(target=_watch_client, args=(conn,), daemon=True, name="zygote-client-watch").start()
    try:
        if code is not None:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - as ``python -c``
        else:
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the worker would report it
        import traceback

        traceback.print_exc()
        return 1


def _child(owned: list, conn: socket.socket, request: dict, fds: list[int], shim: str) -> None:
    """In the forked child: drop the server's descriptors, run the worker, exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for item in owned:
            item.close() if hasattr(item, "close") else os.close(item)
        code = _become_worker(conn, request, fds, shim)
        atexit._run_exitfuncs()  # a worker's exit handlers (Ray's among them), as at a normal interpreter exit
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if "code" in request and code == 0:
            # A spawned process (vLLM's worker) ends as an interpreter does, through the C library's exit: the
            # destructors of the native libraries run (vLLM's CPU communicator unlinks its shared memory in one).
            ctypes.CDLL(None).exit(0)
        os._exit(code)


def serve(path: str, real: bool = False) -> None:
    """Preload, then fork a worker per client until SIGTERM."""
    _die_with_parent()
    _preload(real)
    shim = write_shim(path)
    counter, forked = path.rsplit(".", 1)[0] + ".forks", 0
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select (through the wake-up descriptor)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while not stop:
        for key, _ in sel.select():
            if key.fileobj is not listener:
                os.read(wake_r, 4096)
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child([sel, listener, wake_r, wake_w, *children.values()], conn, request, fds, shim)
            for fd in fds:
                os.close(fd)
            conn.sendall(HEADER.pack(pid))
            children[pid] = conn
            forked += 1
            with open(counter, "w") as count:
                count.write(str(forked))
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(HEADER.pack(status))
                except OSError:  # the client is gone already
                    pass
                conn.close()
    listener.close()
    os.unlink(path)
    os.unlink(shim)


if __name__ == "__main__":
    serve(sys.argv[1], real="--real" in sys.argv[2:])
