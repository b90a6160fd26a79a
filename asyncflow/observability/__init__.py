"""What a run reports while it runs and writes at the end.

- ``MetricsLogger``: scalar metrics per step to JSONL, TensorBoard and wandb (a sink registry for more).
- ``ProgressReporter``: one plain console line per step (reward, throughput, version lag, queue depth).
- ``Timeline``: spans of every worker group, mergeable across processes; Chrome trace + Gantt PNG.
- ``plots``: reward curve and run comparison PNGs.
- ``RunObserver``: all of the above behind one object for the RL loop.
"""

from . import keys
from .config import ObservabilityConfig
from .metrics import SINKS, MetricsLogger, Sink, SinkUnavailable, make_sink, register_sink
from .observer import RunObserver
from .plots import load_jsonl, plot_compare, plot_compare_panels, plot_gantt, plot_reward_curve, rolling_mean
from .progress import ProgressReporter
from .timeline import Timeline

__all__ = [
    "keys",
    "ObservabilityConfig",
    "MetricsLogger",
    "Sink",
    "SinkUnavailable",
    "SINKS",
    "register_sink",
    "make_sink",
    "ProgressReporter",
    "Timeline",
    "RunObserver",
    "load_jsonl",
    "plot_reward_curve",
    "plot_compare",
    "plot_compare_panels",
    "plot_gantt",
    "rolling_mean",
]
