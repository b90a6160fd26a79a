"""A refill spare's CPU policy (``asyncflow.workflow.priority``), in a process of its own: every thread goes to
``SCHED_IDLE`` and back, the threads started before and after included."""

import subprocess
import sys

import pytest

from asyncflow.workflow import priority

SCRIPT = """
import os, threading, time
from asyncflow.workflow import priority

def policies():
    return sorted({os.sched_getscheduler(int(t)) for t in os.listdir('/proc/self/task')})

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a thread older than the call
assert priority.policy() == 'normal' and policies() == [os.SCHED_OTHER]
priority.background()
threading.Thread(target=stop.wait, daemon=True).start()  # started in the background: inherits it
assert priority.policy() == 'idle' and policies() == [os.SCHED_IDLE], policies()
priority.background()  # twice is once
priority.foreground()
assert priority.policy() == 'normal' and policies() == [os.SCHED_OTHER], policies()
priority.foreground()
print('ok')
"""


@pytest.mark.skipif(not priority.can_leave_idle(), reason="this user may not leave SCHED_IDLE (needs root or "
                                                           "RLIMIT_NICE); background() then does nothing")
def test_every_thread_goes_to_the_background_and_back():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
