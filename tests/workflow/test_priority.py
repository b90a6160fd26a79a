"""A refill spare's CPU policy (``asyncflow.workflow.priority``), in a process of its own: every thread goes to
``SCHED_IDLE`` and back, the threads started before and after included, and so does a child process started in the
background (as a vLLM engine's core and workers are)."""

import subprocess
import sys

import pytest

from asyncflow.workflow import priority

SCRIPT = """
import os, subprocess, sys, threading, time
from asyncflow.workflow import priority

def policies(pid='self'):
    return sorted({os.sched_getscheduler(int(t)) for t in os.listdir(f'/proc/{pid}/task')})

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a thread older than the call
assert priority.policy() == 'normal' and policies() == [os.SCHED_OTHER]
priority.background()
threading.Thread(target=stop.wait, daemon=True).start()  # started in the background: inherits it
assert priority.policy() == 'idle' and policies() == [os.SCHED_IDLE], policies()
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # started in the background
time.sleep(0.2)
assert policies(child.pid) == [os.SCHED_IDLE]
priority.background()  # twice is once
priority.foreground()
assert priority.policy() == 'normal' and policies() == [os.SCHED_OTHER], policies()
assert policies(child.pid) == [os.SCHED_OTHER], policies(child.pid)
child.kill()
priority.foreground()
print('ok')
"""


@pytest.mark.skipif(not priority.can_leave_idle(), reason="this user may not leave SCHED_IDLE (needs root or "
                                                           "RLIMIT_NICE); background() then does nothing")
def test_every_thread_goes_to_the_background_and_back():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
