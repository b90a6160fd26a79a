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


def kill_session(sid: int) -> None:
    """SIGKILL every process of the run's session: the driver, Ray's daemons (in their own process groups)
    and every worker, as when a node dies."""
    for _ in range(3):
        for pid in session_processes(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def reap_session(sid: int, grace_s: float = 30.0) -> list[int]:
    """Processes of session ``sid`` still alive ``grace_s`` after its driver ended (Ray's daemons exit right
    after the driver), then SIGKILL whatever is left; returns the survivors."""
    leftovers: list[int] = []
    deadline = time.time() + grace_s
    while time.time() < deadline and (leftovers := session_processes(sid)):
        time.sleep(0.5)
    kill_session(sid)
    return leftovers
