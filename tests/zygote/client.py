"""The raylet's worker command under the tests' fork server (``tests/zygote/server.py``): ask the server for a
worker with this process's arguments, environment, working directory and standard streams, pass signals on to it,
and exit as it exits. Standard library only: this process starts once per Ray worker.

    python tests/zygote/client.py RAY_WORKER_ARGS...
    python tests/zygote/client.py --python [-B] -c CODE ARGS...
    python tests/zygote/client.py --script SCRIPT ARGS...

The second form stands in for the interpreter of a ``multiprocessing`` spawn (the server's children spawn through
it: ``server.write_shim``): the child runs ``CODE`` as ``python -c`` would, with this process's other open descriptors
(the spawn's pipe and resource tracker) at the same numbers. Arguments of another shape run the real interpreter.
The third runs ``python SCRIPT ARGS`` in the child (``tests.zygote.launch_command``: the tests' ``asyncflow``).

The server's socket is ``ASYNCFLOW_TEST_ZYGOTE``, the script the child runs ``ASYNCFLOW_TEST_ZYGOTE_WORKER`` (Ray's
``default_worker.py``): both in the environment the raylet passes on.
"""

import json
import os
import signal
import socket
import struct
import sys
import time

HEADER = struct.Struct("!I")


def _recv_int(conn: socket.socket) -> int | None:
    """One unsigned 32-bit integer from the server (None: it closed first)."""
    data = b""
    while len(data) < HEADER.size:
        more = conn.recv(HEADER.size - len(data))
        if not more:
            return None
        data += more
    return HEADER.unpack(data)[0]


# Interpreter options a spawn passes (``multiprocessing.util._args_from_interpreter_flags``) that change nothing in a
# process forked from the server; with any other, ``--python`` runs the real interpreter.
_HARMLESS = {"-B", "-s", "-u", "-q"}


def _python_request(args: list[str]) -> dict | None:
    """The request for ``python ARGS`` when they are ``[options] -c CODE ...``, else None."""
    i = 0
    while i < len(args) and args[i] in _HARMLESS:
        i += 1
    if args[i:i + 1] != ["-c"] or i + 1 >= len(args):
        return None
    return {"code": args[i + 1], "argv": ["-c", *args[i + 2:]]}


def _open_descriptors() -> list[int]:
    """This process's open descriptors above the standard streams (what a spawn passed it)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.fstat(fd)
            except OSError:  # the listing's own descriptor, closed by now
                continue
            fds.append(fd)
    return fds


def main() -> None:
    """Hand this worker to the server and mirror the child it forks: its signals in, its exit status out."""
    extra: list[int] = []
    if sys.argv[1:2] == ["--python"]:
        request = _python_request(sys.argv[2:])
        if request is None:
            os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
        extra = _open_descriptors()
    elif sys.argv[1:2] == ["--script"]:
        request = {"argv": sys.argv[2:]}
    else:
        request = {"argv": [os.environ["ASYNCFLOW_TEST_ZYGOTE_WORKER"], *sys.argv[1:]]}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(600):  # the server may still be importing when Ray prestarts its first workers
        try:
            conn.connect(os.environ["ASYNCFLOW_TEST_ZYGOTE"])
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.1)
    else:
        sys.exit("the tests' Ray worker fork server never started")
    env = {**os.environ, "ASYNCFLOW_TEST_ZYGOTE_CLIENT": str(os.getpid())}  # the child's client, for the tests
    body = json.dumps({**request, "fds": extra, "env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [HEADER.pack(len(body)) + body], [0, 1, 2, *extra])
    for fd in extra:  # the child holds them now: a pipe's end must close when the child exits, not this process
        os.close(fd)
    pid = _recv_int(conn)
    if pid is None:
        sys.exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    status = _recv_int(conn)
    if status is None:  # the server is gone: the child's status is unknown
        sys.exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
