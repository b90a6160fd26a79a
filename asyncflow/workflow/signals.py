"""Stopping a run on SIGTERM or SIGINT: at the next step boundary, with a checkpoint, within a bounded time.

The first signal asks the loop to stop at the next step boundary (``workflow.loop``): the trainer groups finish
the steps they have begun, save their part of a checkpoint there (``checkpoint.dir`` or ``checkpoint.interval``
set), the driver commits it, writes ``summary.json`` marked as stopped early and tears the run down the normal
way (every actor, process and shared-memory segment of the run). ``asyncflow train`` then prints one line
naming the step and the command that resumes, and exits with ``EX_TEMPFAIL``.

If the boundary is not reached within ``checkpoint.signal_grace_s`` (a step stuck on a dead worker), or a
second signal arrives, the run is torn down at once without a new checkpoint: the previous one stays the
resume point. Signals that arrive while the run is being torn down are ignored, so teardown is never cut short.
"""

from __future__ import annotations

import contextlib
import signal
import threading

EX_TEMPFAIL = 75
"""Exit status of ``asyncflow train`` stopped by a signal (``sysexits.h``: a temporary failure, try again later).
The Slurm template (``recipes/slurm``) requeues a job that exits with it; the job then resumes with ``--resume``."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(Exception):
    """The run stopped early on a signal; raised by ``workflow.loop.train`` after teardown.

    ``step``: steps trained when it stopped; ``signal``: its name (``"SIGTERM"``); ``resume_step``: where
    ``--resume`` continues (None: checkpoints are off, there is nothing to resume from); ``checkpoint``: the
    folder written at the stop (None when none was, e.g. ``reason`` is set); ``reason``: None for a stop at the
    step boundary, else why it stopped without a checkpoint there.
    """

    exit_code = EX_TEMPFAIL

    def __init__(self, step: int, signal_name: str, resume_step: int | None, checkpoint: str | None = None,
                 reason: str | None = None):
        self.step, self.signal, self.resume_step = step, signal_name, resume_step
        self.checkpoint, self.reason = checkpoint, reason
        super().__init__(self.describe())

    def describe(self) -> str:
        """``stopped at step N on SIGTERM`` and, when it stopped before the step boundary, why."""
        text = f"stopped at step {self.step} on {self.signal}"
        return text if self.reason is None else f"{text} ({self.reason})"

    def record(self) -> dict:
        """What ``summary.json`` says about the stop (its ``stopped_early``)."""
        return {"signal": self.signal, "step": self.step, "resume_step": self.resume_step,
                "checkpoint": self.checkpoint, "reason": self.reason}


class StopNow(KeyboardInterrupt):
    """Raised in the driver's main thread by a second signal or when the grace time is over: it unwinds through
    whatever the driver was waiting on. A KeyboardInterrupt, so that no ``except Exception`` swallows it and Ray's
    blocking calls let it through: they turn an exception raised by a signal handler into a plain
    KeyboardInterrupt (any other kind becomes a SystemError), so the reason is kept in ``StopSignals.stop_reason``
    too."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


class StopSignals:
    """The driver's SIGTERM/SIGINT handlers for one run (installed only in the main thread; elsewhere a run has
    none and signals keep their usual effect), and a SIGALRM handler from the first signal on.

    ``requested`` turns true at the first signal; the loop polls it at step boundaries. The first signal also arms
    a timer of ``grace_s`` seconds (``signal.setitimer``) that raises ``StopNow`` unless ``boundary_reached`` came
    first; a second signal raises ``StopNow`` at once. After ``tearing_down`` signals are only noted.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self.stop_reason: str | None = None
        """Why the run stops at once (set just before ``StopNow`` is raised)."""
        self.late_signal: str | None = None
        """A signal that came while a run was being torn down (noted, not acted on)."""
        self._tearing_down = False
        self._armed = False  # the grace timer runs
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """A stop was asked for."""
        return self.signal_name is not None

    def install(self) -> None:
        """(Re)install the handlers; call again after ``ray.init``, which sets a SIGTERM handler of its own."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            self._previous.setdefault(signum, signal.signal(signum, self._on_signal))

    def restore(self) -> None:
        """Put back the handlers found at the first ``install`` and disarm the timer."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.boundary_reached()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    @contextlib.contextmanager
    def installed(self):
        """The handlers for the duration of a ``with`` block."""
        self.install()
        try:
            yield self
        finally:
            self.restore()

    def boundary_reached(self) -> None:
        """The step boundary was reached: the checkpoint is being committed, the grace timer no longer runs."""
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._armed = False

    def tearing_down(self) -> None:
        """From now on signals are noted, never raised: teardown runs to its end."""
        self._tearing_down = True
        self.boundary_reached()

    def rearm(self) -> None:
        """The run starts again after its teardown (a trainer restart, ``workflow.max_restarts``): signals stop it
        again."""
        self._tearing_down = False

    def _on_signal(self, signum, frame) -> None:
        if self._tearing_down:
            self.late_signal = self.late_signal or signal.Signals(signum).name
            return
        if self.signal_name is not None:
            self.stop_reason = f"a second {signal.Signals(signum).name}: no checkpoint at the stop"
            raise StopNow(self.stop_reason)
        self.signal_name = signal.Signals(signum).name
        if self.grace_s > 0:  # handlers run in the main thread: the timer's SIGALRM is handled there too
            self._previous.setdefault(signal.SIGALRM, signal.signal(signal.SIGALRM, self._on_alarm))
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)
            self._armed = True

    def _on_alarm(self, signum, frame) -> None:
        if self._tearing_down or self.signal_name is None:
            return
        self.stop_reason = (f"the step boundary was not reached within checkpoint.signal_grace_s={self.grace_s:g} s: "
                            "no checkpoint at the stop")
        raise StopNow(self.stop_reason)

    def stopping_now(self, exc: BaseException) -> bool:
        """``exc`` is this object's ``StopNow``, possibly as the KeyboardInterrupt a Ray call made of it."""
        return isinstance(exc, KeyboardInterrupt) and self.stop_reason is not None


def stopped_line(stop: RunStopped, command: str) -> str:
    """The one line ``asyncflow train`` prints when a signal stopped it; ``command`` resumes the run."""
    if stop.resume_step is None:
        return (f"asyncflow: {stop.describe()}; nothing to resume from: checkpoints are off (set checkpoint.dir "
                "to make a stopped run resumable)")
    line = f"asyncflow: {stop.describe()}; resume with: {command}"
    return line if stop.resume_step == stop.step else f"{line} (continues from step {stop.resume_step})"
