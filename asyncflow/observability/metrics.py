"""Scalar metrics per step, fanned out to sinks: JSONL, TensorBoard, wandb, or a user's own.

Sinks form a small name -> class registry. A user sink subclasses ``Sink``, registers itself with
``@register_sink("name")`` and is requested with ``MetricsLogger(cfg, extra_sinks=["name"])``. A sink
whose dependency is missing raises ``SinkUnavailable`` in its constructor; the logger then prints a
one-line warning and runs without it, because a missing wandb must never cost a training run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import ObservabilityConfig

logger = logging.getLogger(__name__)

RESERVED_KEYS = ("step", "time", "elapsed")
"""Keys every JSONL record carries; metrics may not use them."""


class SinkUnavailable(RuntimeError):
    """A sink cannot run here (its package is missing or it failed to start); the run goes on without it."""


class Sink:
    """Receives every logged step. Subclasses implement ``write`` and, when they hold resources, ``close``.

    The constructor receives the run's ``ObservabilityConfig`` and the run's configuration as a plain
    dict (for sinks that record hyperparameters), and may raise ``SinkUnavailable``.
    """

    name = "base"

    def __init__(self, cfg: ObservabilityConfig, run_config: Mapping[str, Any] | None = None):
        self.cfg = cfg

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float, elapsed: float) -> None:
        """Record one step: metric values (floats, possibly NaN), unix ``wall_time``, seconds since start."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release resources; called once."""


SINKS: dict[str, type[Sink]] = {}


def register_sink(name: str) -> Callable[[type[Sink]], type[Sink]]:
    """Class decorator: make a ``Sink`` subclass available under ``name``."""

    def wrap(cls: type[Sink]) -> type[Sink]:
        if name in SINKS and SINKS[name] is not cls:
            raise ValueError(f"metrics sink {name!r} is already registered by {SINKS[name].__name__}")
        SINKS[name] = cls
        cls.name = name
        return cls

    return wrap


def make_sink(name: str, cfg: ObservabilityConfig, run_config: Mapping[str, Any] | None = None) -> Sink:
    """Instantiate a registered sink; an unknown name raises ValueError listing the valid ones."""
    cls = SINKS.get(name)
    if cls is None:
        raise ValueError(f"unknown metrics sink {name!r}; valid sinks: {', '.join(sorted(SINKS))}")
    return cls(cfg, run_config)


@register_sink("jsonl")
class JsonlSink(Sink):
    """``metrics.jsonl``: one JSON object per step with ``step``, unix ``time``, ``elapsed`` and the metrics.

    The file is started afresh by each run (continued with ``append``). Every line is flushed, so a crashed
    run keeps its history and ``tail -f`` works. Non-finite values are written as ``null`` to keep the file strict JSON.
    """

    def __init__(self, cfg: ObservabilityConfig, run_config: Mapping[str, Any] | None = None):
        super().__init__(cfg, run_config)
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if cfg.append else "w", encoding="utf-8")  # closed in close()

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float, elapsed: float) -> None:
        record = {"step": step, "time": wall_time, "elapsed": elapsed}
        record.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@register_sink("tensorboard")
class TensorBoardSink(Sink):
    """TensorBoard scalars under ``output_dir/tensorboard`` (PyTorch's ``SummaryWriter``)."""

    def __init__(self, cfg: ObservabilityConfig, run_config: Mapping[str, Any] | None = None):
        super().__init__(cfg, run_config)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise SinkUnavailable(f"tensorboard is not importable ({exc}); pip install tensorboard") from exc
        self.log_dir = Path(cfg.output_dir) / "tensorboard"
        # A short flush interval so a live `tensorboard --logdir` follows the run.
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float, elapsed: float) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()


def wandb_mode(cfg: ObservabilityConfig, environ: Mapping[str, str] | None = None) -> str:
    """The mode the wandb sink starts in: ``cfg.wandb_mode`` when set, else W&B's own default (``WANDB_MODE`` from
    ``environ``, the process environment by default, when set; else ``online``), so that naming a project logs to
    it as the W&B documentation says."""
    environ = os.environ if environ is None else environ
    return cfg.wandb_mode or environ.get("WANDB_MODE") or "online"


@register_sink("wandb")
class WandbSink(Sink):
    """Weights & Biases run in ``cfg.wandb_project``, in the mode ``wandb_mode`` picks (online unless told)."""

    def __init__(self, cfg: ObservabilityConfig, run_config: Mapping[str, Any] | None = None):
        super().__init__(cfg, run_config)
        try:
            import wandb
        except ImportError as exc:
            raise SinkUnavailable(f"wandb_project={cfg.wandb_project!r} but wandb is not installed "
                                  "(pip install wandb); continuing without wandb") from exc
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        try:
            mode = wandb_mode(cfg)
            self._run = wandb.init(project=cfg.wandb_project, mode=mode, dir=cfg.output_dir,
                                   config=dict(run_config or {}))
        except Exception as exc:  # a login or network failure must not stop training
            raise SinkUnavailable(f"wandb.init failed in mode {mode} ({type(exc).__name__}: {exc}); continuing "
                                  "without wandb (observability.wandb_mode=offline logs without a network)") from exc
        logger.info("wandb: project %s, mode %s", cfg.wandb_project, mode)

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float, elapsed: float) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def _as_float(key: str, value: Any) -> float:
    # float() accepts Python and NumPy numbers and one-element tensors, so callers need not convert.
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}") from exc


class MetricsLogger:
    """Logs scalar metrics per step to the sinks the config enables (JSONL, TensorBoard, wandb) plus extras.

    Usable as a context manager. Thread-safe: service threads may log their own steps.

    Args:
        cfg: which sinks, and where they write.
        extra_sinks: more sinks, by registry name or as ready instances.
        run_config: the run's configuration as a plain dict, recorded by sinks that keep hyperparameters.
        start_time: unix time at which the run started (default: now); ``elapsed`` is measured from it.
    """

    def __init__(self, cfg: ObservabilityConfig, extra_sinks: Sequence[str | Sink] = (),
                 run_config: Mapping[str, Any] | None = None, start_time: float | None = None):
        self.cfg = cfg
        self.start_time = time.time() if start_time is None else start_time
        names = [n for n, on in (("jsonl", cfg.jsonl), ("tensorboard", cfg.tensorboard),
                                 ("wandb", cfg.wandb_project is not None)) if on]
        self.sinks: list[Sink] = []
        if run_config is not None:  # sinks such as wandb upload it; secrets must never leave the process
            from asyncflow.config_loader import redact_secrets

            run_config = redact_secrets(run_config)
        for sink in [*names, *extra_sinks]:
            if isinstance(sink, Sink):
                self.sinks.append(sink)
                continue
            try:
                self.sinks.append(make_sink(sink, cfg, run_config))
            except SinkUnavailable as exc:
                logger.warning("metrics sink %r disabled: %s", sink, exc)
        self._lock = threading.Lock()
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (name -> number; None values are skipped) for optimizer step ``step``."""
        clash = [k for k in metrics if k in RESERVED_KEYS]
        if clash:
            raise ValueError(f"metric names {clash} are reserved (every record carries {list(RESERVED_KEYS)})")
        values = {k: _as_float(k, v) for k, v in metrics.items() if v is not None}
        now = time.time()
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log called after close()")
            for sink in self.sinks:
                sink.write(int(step), values, now, now - self.start_time)

    def close(self) -> None:
        """Flush and close every sink; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sink in self.sinks:
                sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
