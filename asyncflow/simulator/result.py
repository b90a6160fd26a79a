"""What a simulation predicts (``SimResult``), shared by the step-tied pipeline (``sim``) and the sample stream
(``stream``)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from asyncflow.observability.timeline import Timeline
from asyncflow.simulator.workload import Workload


@dataclasses.dataclass
class SimResult:
    """What a simulation predicts."""

    workload: Workload
    step_end_s: list[float]
    """When each step's new weights were published (seconds from the start)."""
    samples_per_s: float
    """Trained rows per second after the first ``workload.warmup_steps`` steps."""
    step_time_s: float
    """Mean seconds per step after the warm-up steps."""
    idle_fraction: dict[str, float]
    """Per task: 1 - busy time / the run's span (as ``Timeline.idle_fractions`` reports real runs)."""
    lags: list[list[int]]
    """Per step: the version lag (training version - generating version) of every trained row."""
    timeline: Timeline
    """Every simulated span, for ``plot_gantt`` and the Chrome trace."""
    busy_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per device: seconds in which it ran at least one job (all of its work, as a device is never idle with
    work)."""
    dropped: int = 0
    """``stream``: groups that fell out of the staleness bound and were generated again."""
    trained: list[int] = dataclasses.field(default_factory=list)
    """``stream``: the prompt id of every trained group, in training order."""
    trained_lengths: list[int] = dataclasses.field(default_factory=list)
    """``stream``: the response length of every trained row, in training order (the stream trains the groups that
    finish first, so these run shorter than the drawn ones)."""

    @property
    def lag_mean(self) -> float:
        """Mean version lag over every trained row."""
        flat = [x for step in self.lags for x in step]
        return sum(flat) / max(len(flat), 1)

    @property
    def lag_max(self) -> int:
        """Largest version lag of any trained row."""
        return max((x for step in self.lags for x in step), default=0)

    def spans_per_step(self, engine: bool = False) -> dict[str, float]:
        """Mean seconds per step of each span name (``engine``: of the spans' engine seconds, for the span names
        that record them), as a real run's ``timeline.json`` is read."""
        sums: dict[str, float] = defaultdict(float)
        steps = len(self.step_end_s)
        for e in self.timeline.to_chrome_trace()["traceEvents"]:
            if e.get("ph") == "X" and (not engine or "engine_s" in e.get("args", {})):
                sums[e["name"]] += (e["args"]["engine_s"] if engine else e["dur"] / 1e6) / steps
        return dict(sums)
