"""Configuration of what a run reports while it runs and writes at the end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ObservabilityConfig:
    """Metrics sinks, console progress, timeline trace and plots of one run."""

    output_dir: str = "outputs/run"
    """Directory for ``metrics.jsonl``, ``tensorboard/``, ``timeline.json``/``.png`` and the plots."""
    jsonl: bool = True
    """Append one JSON object per step to ``metrics.jsonl`` (the record every plot is drawn from)."""
    append: bool = False
    """Continue an existing ``metrics.jsonl`` instead of starting it afresh (``asyncflow train --resume`` sets
    it, after dropping the lines of steps the resumed run trains again)."""
    tensorboard: bool = True
    """Write TensorBoard scalars under ``output_dir/tensorboard``."""
    wandb_project: str | None = None
    """Weights & Biases project; None disables wandb. When set but wandb is not installed, a warning."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """``wandb.init`` mode: ``online``, ``offline`` (sync later with ``wandb sync``) or ``disabled``. None follows
    W&B's own rule: the ``WANDB_MODE`` environment variable when set, else ``online``."""
    progress_every_s: float = 2.0
    """Least seconds between two console progress lines (0 prints every step; the last step always prints)."""
    timeline: bool = True
    """Record spans of every worker group and write ``timeline.json`` (Chrome trace) and ``timeline.png``."""
    plots: bool = True
    """Write PNG plots at the end of the run (reward curve, timeline Gantt chart)."""
