"""The raylet's worker command under the tests' fork server (``tests/zygote/server.py``): ask the server for a
worker with this process's arguments, environment, working directory and standard streams, pass signals on to it,
and exit as it exits. Standard library only: this process starts once per Ray worker.

    python tests/zygote/client.py RAY_WORKER_ARGS...

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


def main() -> None:
    """Hand this worker to the server and mirror the child it forks: its signals in, its exit status out."""
    worker = os.environ["ASYNCFLOW_TEST_ZYGOTE_WORKER"]
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
    body = json.dumps({"argv": [worker, *sys.argv[1:]], "env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [HEADER.pack(len(body)) + body], [0, 1, 2])
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
