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
