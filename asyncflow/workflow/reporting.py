"""Turns the services' per-step reports into metrics, progress lines, a timeline and a summary."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import defaultdict

from asyncflow.config import AsyncFlowConfig
from asyncflow.observability import RunObserver, keys
from asyncflow.observability.logprob_gap import gap_problems, merge_stats
from asyncflow.workflow.evaluation import EVAL_SERVICE, write_samples

TRAINERS = {"actor", "critic"}
"""The services whose spans end a step on its clock (``time/elapsed_s``, samples/s)."""

ADDITIVE = ("/rows", "/tokens", "/weight_swaps", "/observations", "/errors", "/stale_retries", "/stale_groups",
            "/failures", "/restarts")
"""Metrics that count something: the step's value is the sum over the instances that report it."""


def merge_metric(key: str, old: float, new: float, seen: int) -> float:
    """The step's value of ``key`` once one more report carries it (``seen`` reports before it, whose merged value
    is ``old``): counts add up, a ``_max`` is the largest and a ``_min`` (or the first version a step was generated
    with) the smallest, and a ``_mean`` is the mean over the reports; anything else is the latest report's."""
    if key.endswith(ADDITIVE):
        return old + new
    if key.endswith("_max"):
        return max(old, new)
    if key.endswith("_min") or key == "rollout/version":
        return min(old, new)
    if key.endswith("_mean"):
        return (old * seen + new) / (seen + 1)
    return new


class Reporter:
    """Collects reports from the version board; a step is logged once its rollout, reward, advantage and actor
    reports are in (the critic's too, when PPO runs one). The reward's is required though the advantage service
    sees every reward of the step: the reward worker posts its report after its last put, so the step could
    otherwise be trained and logged before it arrives, and its counts (``reward/failures``) would be lost."""

    def __init__(self, cfg: AsyncFlowConfig, pipe, first_step: int = 0, trained_groups: dict | None = None,
                 on_step=None):
        self.cfg, self.pipe = cfg, pipe
        self.first_step, self.on_step = first_step, on_step
        self.required = {"actor", "advantage", "reward", "rollout"} | ({"critic"} & set(pipe.groups))
        self.observer = RunObserver(cfg.observability, total_steps=cfg.workflow.steps,
                                    run_config=dataclasses.asdict(cfg))
        self.pending: dict[int, dict] = defaultdict(dict)
        self.history: list[dict] = []
        self.trained_steps = first_step
        # Resumed runs start with the record of the checkpoint, so the summary covers the whole run.
        self.trained_groups: dict[int, list[int]] = {int(k): v for k, v in (trained_groups or {}).items()}
        self.t_start = time.time()
        self.t_last = self.t_start
        self.reported: dict[tuple[str, int], int] = {}
        """(service, worker) -> the last step it reported (where a restarted worker goes on)."""
        self.extra_summary: dict = {}
        """Records added to ``summary.json`` (the supervisor's restarts)."""

    def collect(self, reports: list[dict] | None = None) -> None:
        """Take ``reports`` (sync mode) or pull them from the board (async); log every complete step."""
        import ray

        if reports is None:
            reports = ray.get(self.pipe.board.take_reports.remote())
        for item in reports:
            self.observer.timeline.merge(item["spans"])
            who = (item["service"], item.get("worker", 0))
            self.reported[who] = max(self.reported.get(who, -1), item["step"])
            step = item["step"]
            if step < self.trained_steps and item["service"] != EVAL_SERVICE:
                continue  # a sample-stream instance's share of a step already logged
            if item["service"] == EVAL_SERVICE:
                # An evaluation that ended after its step was logged goes with the next one, and one that finds its
                # step holding another evaluation (two ended within one step of a fast trainer) with the step after:
                # one evaluation per logged step, never two merged into one record.
                step = max(step, self.trained_steps)
                while EVAL_SERVICE in self.pending.get(step, {}).get("_services", ()):
                    step += 1
                if step >= self.cfg.workflow.steps:  # no step left to log it with: neither metrics nor samples
                    continue
            pending = self.pending[step]
            counts = pending.setdefault("_reports", defaultdict(int))
            for key, value in item["metrics"].items():
                if key in pending:  # several rollout instances report the same step
                    value = merge_metric(key, pending[key], value, counts[key])
                pending[key] = value
                counts[key] += 1
            pending.setdefault("_services", set()).add(item["service"])
            # The step's clock: when the trainer's last span of it ended (the actor's weights staged), not when this
            # driver polled the board, up to 0.2 s later (``Feeder.wait``), which would skew per-step times
            # and samples/s in async runs. Only the trainers' spans: a rollout instance's load of the new weights
            # goes with this step's report or the next one's, as it happens to end before or after the report.
            ends = [span["end"] for span in item["spans"]] if item["service"] in TRAINERS else []
            if ends:
                pending["_end"] = max(pending.get("_end", 0.0), max(ends))
            if "trained_groups" in item:
                self.trained_groups[step] = item["trained_groups"]
            if item.get("eval_samples"):  # validation responses of an evaluation (``workflow.evaluation``)
                write_samples(self.cfg.observability.output_dir, step, item["eval_samples"])
        while True:
            step = self.trained_steps
            have = self.pending.get(step, {}).get("_services", set())
            if not self.required <= have:
                return
            self._log(step, self.pending.pop(step))
            self.trained_steps += 1
            if self.on_step is not None:
                self.on_step(step)

    def _log(self, step: int, metrics: dict) -> None:
        metrics.pop("_services")
        metrics.pop("_reports", None)
        # Without spans (``observability.timeline`` off) the driver's clock is the only one.
        now = max(metrics.pop("_end", None) or time.time(), self.t_last)
        dt = max(now - self.t_last, 1e-9)
        self.t_last = now
        metrics[keys.SAMPLES_PER_S] = metrics.get("actor/rows", 0.0) / dt
        metrics[keys.TOKENS_PER_S] = metrics.get("rollout/tokens", 0.0) / dt
        metrics[keys.QUEUE_DEPTH] = float(self.pipe.client.status().get("live_rows", 0))
        metrics["time/elapsed_s"] = now - self.t_start
        metrics["ray/object_store_bytes"] = object_store_bytes()
        self.history.append({"step": step, **metrics})
        self.observer.log(step, metrics)

    def finish(self, stopped: dict | None = None) -> dict:
        """Write plots, timeline and ``summary.json``; return the summary. ``stopped``: the run stopped early on a
        signal (``workflow.signals.RunStopped.record``), written as the summary's ``stopped_early``."""
        wall = time.time() - self.t_start
        rewards = [h.get(keys.REWARD_MEAN, math.nan) for h in self.history]
        lags = [h.get(keys.LAG_MAX, 0.0) for h in self.history]
        gap = merge_stats([{stat: h[f"check/fresh_logprob_gap_{stat}"] for stat in ("mean", "p99", "max", "tokens")}
                           for h in self.history if "check/fresh_logprob_gap_tokens" in h])
        idle = self.observer.timeline.idle_fractions() if len(self.observer.timeline) else {}
        self.observer.close()
        tail = rewards[-10:]
        summary = {
            "mode": self.cfg.workflow.mode,
            "max_staleness": self.cfg.workflow.max_staleness,
            "steps": len(self.history),
            "first_step": self.first_step,
            "wall_s": wall,
            # The wall clock at the run's start: a step's ``time/elapsed_s`` plus this is when it ended, to line the
            # steps up with outside measurements (``bench/e2e.py`` reads the machine's CPU over the steady steps).
            "started_unix_s": self.t_start,
            "reward_first": rewards[0] if rewards else math.nan,
            "reward_last10_mean": sum(tail) / len(tail) if tail else math.nan,
            "reward_tail_steps": len(tail),  # what reward_last10_mean averaged: fewer than 10 in a short run
            "first_step_reward_ge_0.8": next((h["step"] for h in self.history if h.get(keys.REWARD_MEAN, 0) >= 0.8),
                                             None),
            "max_version_lag": max(lags) if lags else 0.0,
            # vLLM vs Megatron on the tokens of the trained version, over the run (``observability.logprob_gap``)
            **{f"fresh_logprob_gap_{stat}": gap.get(stat) for stat in ("mean", "p99", "max", "tokens")},
            "fresh_logprob_gap_problems": gap_problems(gap, self.cfg.trainer.params_dtype) if gap else [],
            "samples_per_s": sum(h.get("actor/rows", 0) for h in self.history) / max(wall, 1e-9),
            "tokens_per_s": sum(h.get("rollout/tokens", 0) for h in self.history) / max(wall, 1e-9),
            "idle_fraction": idle,
            "rewards": rewards,
            "lags_max_per_step": lags,
            # Sample stream: groups that finished beyond their staleness bound and were generated again.
            "stale_groups": sum(h.get("stream/stale_groups", 0.0) for h in self.history),
            "trained_groups": {str(k): v for k, v in sorted(self.trained_groups.items())},
            "stopped_early": stopped,  # None for a run that trained all its steps
            **self.extra_summary,
        }
        out = self.observer.output_dir / "summary.json"
        out.write_text(json.dumps(summary, indent=2))
        return summary


def object_store_bytes() -> float:
    """Bytes in Ray's object store over the cluster's nodes right now (NaN where Ray cannot tell).

    Weights never travel through it (``asyncflow.bridge.staging``); this metric is how a run shows that. It
    reads Ray's per-node store stats through ``ray._private.internal_api`` (checked on Ray 2.60): Ray has no
    public call for used plasma bytes.
    """
    import ray

    try:
        from ray._private import internal_api

        state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
        return float(internal_api.get_memory_info_reply(state, timeout_seconds=5).store_stats.object_store_bytes_used)
    except Exception:  # noqa: BLE001 - a metric must never stop the run
        return math.nan
