"""CPU priority of a spare rollout instance started while the run goes on (the refill of the spare pool).

Its process start (Python, Ray, an import of torch, the engine's build) is seconds of CPU that nothing waits for.
On a host whose cores the run's own processes share, it would slow them for that long, so it runs under Linux's
``SCHED_IDLE`` policy (CPU time only where no other process wants it) from its first instruction: ``HOOK`` runs in
the Ray worker before the actor's class is imported. It goes back to the normal policy when it takes a dead
instance's slot (``foreground``). A process may always move to ``SCHED_IDLE`` but may leave it only with
``CAP_SYS_NICE`` (root) or an ``RLIMIT_NICE`` that allows its niceness: where it could not leave, it never enters
(``background`` does nothing), so a promoted spare never serves in the background.

Linux keeps the policy per thread, and a thread or process started later inherits its creator's: both functions set
every thread of the process (``/proc/<pid>/task``), and ``foreground`` also those of its descendants (a vLLM engine's
core and workers, which the spare started while it was in the background).
"""

from __future__ import annotations

import os
import resource

HOOK = f"{__name__}.background"
"""What a spare started in the background runs first (``WorkerGroups.rollout_instance``)."""

_background = False


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:  # the process ended meanwhile
        return []


def _set(policy: int, descendants: bool = False) -> None:
    import psutil

    pids = [os.getpid()]
    if descendants:
        pids += [child.pid for child in psutil.Process().children(recursive=True)]
    for tid in (tid for pid in pids for tid in _threads(pid)):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def can_leave_idle() -> bool:
    """Whether this process could leave ``SCHED_IDLE`` again (root, or ``RLIMIT_NICE`` allows its niceness)."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= os.getpriority(os.PRIO_PROCESS, 0)


def policy() -> str:
    """The scheduling policy of this process's main thread: ``idle`` or ``normal`` (what ``layout.json`` shows)."""
    return "idle" if os.sched_getscheduler(os.getpid()) == os.SCHED_IDLE else "normal"


def background() -> None:
    """Every thread of this process to ``SCHED_IDLE``, where ``foreground`` can undo it (Linux only)."""
    global _background
    if not _background and hasattr(os, "SCHED_IDLE") and can_leave_idle():
        _set(os.SCHED_IDLE)
        _background = True


def foreground() -> None:
    """Back to the normal policy, with every process started meanwhile (nothing where ``background`` did nothing)."""
    global _background
    if _background:
        _set(os.SCHED_OTHER, descendants=True)
        _background = False
