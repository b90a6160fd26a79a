"""``RunObserver``: everything a run reports, behind one object, so the RL loop stays short.

    with RunObserver(cfg.observability, total_steps=cfg.steps, run_config=asdict(cfg)) as obs:
        for step in range(1, cfg.steps + 1):
            with obs.timeline.span("actor", "train_step", worker=0):
                ...
            obs.log(step, {keys.REWARD_MEAN: r, keys.SAMPLES_PER_S: sps, ...})
    # metrics.jsonl, tensorboard/, timeline.json, timeline.png and reward.png are now in cfg.output_dir
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import keys
from .config import ObservabilityConfig
from .metrics import MetricsLogger, Sink
from .plots import plot_reward_curve
from .progress import ProgressReporter
from .timeline import Timeline

logger = logging.getLogger(__name__)


class RunObserver:
    """Metrics sinks, console progress and a timeline for one run; ``close`` writes the trace and plots.

    Args:
        cfg: what to report and where.
        total_steps: optimizer steps of the run, for ``step/total`` and the ETA (None when unknown).
        run_config: the run's configuration as a plain dict (recorded by wandb).
        extra_sinks: more metrics sinks, by registry name or instance.
    """

    def __init__(self, cfg: ObservabilityConfig, total_steps: int | None = None,
                 run_config: Mapping[str, Any] | None = None, extra_sinks: Sequence[str | Sink] = ()):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.timeline = Timeline(enabled=cfg.timeline)
        self.metrics = MetricsLogger(cfg, extra_sinks=extra_sinks, run_config=run_config)
        self.progress = ProgressReporter(total_steps, every_s=cfg.progress_every_s)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log ``metrics`` of ``step`` to every sink and report progress on the console."""
        self.metrics.log(step, metrics)
        self.progress.update(step, metrics)

    def close(self) -> list[Path]:
        """Close the sinks; write the timeline (JSON + PNG) and the reward curve; print a summary line.

        Runs after a failure too (the context manager calls it), so a crashed run still leaves its
        trace. A plot that cannot be drawn is reported as a warning and skipped. Returns the files written.
        """
        if self._closed:
            return []
        self._closed = True
        self.metrics.close()
        written: list[Path] = []
        idle = ""
        if self.cfg.timeline and len(self.timeline):
            written += self.timeline.write(self.output_dir, plot=self.cfg.plots)
            idle = "idle " + ", ".join(f"{g} {f:.0%}" for g, f in self.timeline.idle_fractions().items())
        jsonl = self.output_dir / "metrics.jsonl"
        if self.cfg.plots and self.cfg.jsonl and jsonl.exists():
            try:
                written.append(plot_reward_curve(jsonl, self.output_dir / "reward.png", key=keys.REWARD_MEAN))
            except ValueError as exc:  # e.g. a run that never logged a reward
                logger.warning("reward curve not written: %s", exc)
        self.progress.finish(" | ".join(p for p in (idle, f"outputs in {self.output_dir}") if p))
        return written

    def __enter__(self) -> RunObserver:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
