"""Process helpers for tests that run ``asyncflow train`` in a session of its own."""

import os
import signal
import subprocess
import time


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies waiting to be reaped by init do not count)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True).stdout
    return [int(pid) for pid, s, stat in (line.split() for line in out.splitlines())
            if s == str(sid) and not stat.startswith("Z")]


def kill_session(sid: int, timeout_s: float = 60.0) -> list[int]:
    """SIGKILL every process of the run's session (the driver, Ray's daemons in their own process groups and
    every worker, as when a node dies), again and again until none is left or ``timeout_s`` passed; returns the
    processes still alive then. A killed process takes a while to exit on a loaded machine, and a daemon may start
    a worker while the others die: a fixed number of rounds once left such processes behind."""
    deadline = time.time() + timeout_s
    while (alive := session_processes(sid)) and time.time() < deadline:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return session_processes(sid)


def reap_session(sid: int, grace_s: float = 30.0) -> list[int]:
    """Processes of session ``sid`` still alive ``grace_s`` after its driver ended (Ray's daemons exit right
    after the driver), then SIGKILL whatever is left; returns the survivors of the grace period."""
    leftovers: list[int] = []
    deadline = time.time() + grace_s
    while time.time() < deadline and (leftovers := session_processes(sid)):
        time.sleep(0.5)
    kill_session(sid)
    return leftovers


def run_in_session(cmd: list[str], cwd, env: dict | None = None, timeout_s: float = 600.0
                   ) -> tuple[int, str, str, list[int]]:
    """Run ``cmd`` in a session of its own to its end; ``(exit status, stdout, stderr, processes of the session
    still alive 30 s after it ended)`` (those are killed)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=None if env is None else {**os.environ, **env})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        leftovers = reap_session(proc.pid)
    return proc.returncode, out, err, leftovers
