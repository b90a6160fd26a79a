"""The device split search: how many devices should generate, how many should train, and at what rollout TP.

For a cluster recipe with ``D`` devices, every split ``rollout_instances x rollout.tensor_parallel +
trainer TP x PP x DP = D`` (the trainer's TP and PP kept, DP taking the rest) is checked against
``asyncflow plan``'s memory model (``planner.plan.estimate``: every task must fit ``DEVICE_MEMORY_GB``) and
the ones that fit are simulated. Rollout costs per TP come from the cost file's ``device-tp{N}`` variant
when it has one, else from its ``device`` variant (a single-device measurement cannot say how TP scales:
the search then assumes ``TP_EFFICIENCY`` per doubling and says so).
"""

from __future__ import annotations

import dataclasses
import itertools

from asyncflow.simulator.costs import CostFile, CostModel
from asyncflow.simulator.sim import SimResult, simulate
from asyncflow.simulator.workload import Workload

PACKED_MODES = ("stream", "colocated")
"""Modes whose trainer packs rows and balances them over any number of replicas (``simulator.stream``)."""
STREAM_SHARES = (1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)
"""Rollout's shares of the devices that ``mode_search`` tries."""
TP_EFFICIENCY = 0.8
"""Assumed decode speed-up per doubling of rollout TP, relative to ideal, when the cost file has no
``device-tp{N}`` variant (an assumption, not a measurement)."""


@dataclasses.dataclass
class Split:
    """One candidate split and what the planner and the simulator say about it."""

    rollout_instances: int
    rollout_tp: int
    trainer_dp: int
    fits: bool
    """Every task fits its devices (``asyncflow plan``'s estimate)."""
    memory: str
    """The tightest task's total against its budget, GiB."""
    result: SimResult | None = None
    """The simulation (None when the split does not fit)."""

    @property
    def rollout_devices(self) -> int:
        """Devices that generate."""
        return self.rollout_instances * self.rollout_tp

    def overrides(self) -> list[str]:
        """The split as ``section.key=value`` overrides."""
        return [f"workflow.rollout_instances={self.rollout_instances}", f"rollout.tensor_parallel={self.rollout_tp}",
                f"trainer.data_parallel={self.trainer_dp}"]


def costs_for_tp(costs: CostFile, tp: int) -> tuple[CostModel, bool]:
    """Costs of a rollout engine at TP ``tp``: the measured variant, or ``device`` scaled (second: measured?)."""
    if f"device-tp{tp}" in costs.variants:
        return costs.variant(f"device-tp{tp}"), True
    base = costs.variant("device")
    speedup = tp * TP_EFFICIENCY ** (tp.bit_length() - 1)
    r = base.rollout
    rollout = dataclasses.replace(r, per_seq_s=r.per_seq_s / speedup, per_ctx_token_s=r.per_ctx_token_s / speedup,
                                  prefill_per_token_s=r.prefill_per_token_s / speedup)
    return dataclasses.replace(base, rollout=rollout), tp == 1


def _memory(recipe, overrides: list[str]) -> tuple[bool, str]:
    from asyncflow.planner.memory import GIB
    from asyncflow.planner.plan import estimate

    if recipe is None or recipe.cluster.device_memory_gb is None:
        return True, "no memory model"
    cfg = _override(recipe.cfg, overrides)
    tasks = estimate(dataclasses.replace(recipe, cfg=cfg))
    worst = max(tasks, key=lambda t: t.total / t.budget)
    return all(t.fits for t in tasks), f"{worst.task} {worst.total / GIB:.0f}/{worst.budget / GIB:.0f}"


def _override(cfg, overrides: list[str]):
    from asyncflow.config import replace_section

    for item in overrides:
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".")
        cfg = replace_section(cfg, section, **{key: type(getattr(getattr(cfg, section), key))(value)})
    return cfg


def candidate_splits(devices: int, w: Workload, trainer_mp: int, devices_per_node: int, points: int = 15
                     ) -> list[tuple[int, int, int]]:
    """``(rollout instances, rollout TP, trainer DP)`` splits of ``devices``: about ``points`` rollout shares
    per TP, trainer DP a whole number of ``trainer_mp``-device replicas that divides the step's rows."""
    out = set()
    for tp in (1, 2, 4, 8):
        if tp > devices_per_node:
            continue
        for i in range(1, points + 1):
            rollout = round(devices * i / (points + 1) / tp) * tp
            train = devices - rollout
            if rollout < tp or train < trainer_mp or train % trainer_mp:
                continue
            dp = train // trainer_mp
            if w.mode not in PACKED_MODES and w.rows_per_step % (w.micro_batch_size * dp):
                continue  # the stream's packed trainer balances tokens: any DP size takes the step's rows
            out.add((rollout // tp, tp, dp))
    return sorted(out, key=lambda s: (s[1], s[0]))


def search(w: Workload, costs: CostFile, devices: int, recipe=None, trainer_mp: int = 1,
           devices_per_node: int = 8, progress=None) -> list[Split]:
    """Every candidate split of ``devices``, simulated where it fits; best throughput first."""
    splits = []
    for instances, tp, dp in candidate_splits(devices, w, trainer_mp, devices_per_node):
        split = Split(instances, tp, dp, True, "")
        split.fits, split.memory = _memory(recipe, split.overrides())
        if split.fits:
            model, _ = costs_for_tp(costs, tp)
            trial = dataclasses.replace(w, rollout_instances=instances, data_parallel=dp)
            split.result = simulate(trial, model)
        splits.append(split)
        if progress is not None:
            progress()
    return sorted(splits, key=lambda s: -(s.result.samples_per_s if s.result else -1.0))


@dataclasses.dataclass
class ModeChoice:
    """One sample-stream candidate: rollout model, staleness and split, and its simulation."""

    rollout_model: str
    max_staleness: int
    rollout_instances: int
    rollout_tp: int
    trainer_dp: int
    result: SimResult

    @property
    def bound(self) -> str:
        """The side that sets the pace: the trainer when it is never short of groups, else rollout."""
        return "trainer" if self.result.idle_fraction.get("actor", 0.0) < 0.05 else "rollout"

    def overrides(self) -> list[str]:
        """The choice as ``section.key=value`` overrides."""
        return ["workflow.mode=stream", f"workflow.max_staleness={self.max_staleness}",
                f"rollout.partial={str(self.rollout_model == 'partial').lower()}",
                f"workflow.rollout_instances={self.rollout_instances}", f"rollout.tensor_parallel={self.rollout_tp}",
                f"trainer.data_parallel={self.trainer_dp}"]


def mode_search(w: Workload, model: CostModel, devices: int, trainer_mp: int, rollout_tp: int, recipe=None,
                shares=STREAM_SHARES, staleness=(1, 2), models=("partial", "continuous"), progress=None
                ) -> list[ModeChoice]:
    """The sample stream of ``w`` at every rollout share of ``devices`` (down to a quarter; any trainer DP: the
    packed trainer balances tokens), rollout model and staleness bound; fitting ones simulated, best first."""
    out = []
    for share in shares:
        instances = max(1, round(devices * share / rollout_tp))
        dp = (devices - instances * rollout_tp) // trainer_mp
        if dp < 1:
            continue
        split = Split(instances, rollout_tp, dp, True, "")
        if not _memory(recipe, split.overrides())[0]:
            continue
        for rollout_model, k in itertools.product(models, staleness):
            trial = dataclasses.replace(w, mode="stream", rollout_model=rollout_model, max_staleness=k,
                                        rollout_instances=instances, data_parallel=dp, packing=True)
            out.append(ModeChoice(rollout_model, k, instances, rollout_tp, dp, simulate(trial, model)))
            if progress is not None:
                progress(out[-1])
    return sorted(out, key=lambda c: -c.result.samples_per_s)


def colocated_baseline(w: Workload, model: CostModel, devices: int, trainer_mp: int, rollout_tp: int) -> SimResult:
    """The colocated baseline on ``devices``: every device generates (``rollout_tp`` per engine), switches
    (``CostModel.switch``), then trains (``trainer_mp`` per replica)."""
    return simulate(dataclasses.replace(w, mode="colocated", max_staleness=0, rollout_instances=devices // rollout_tp,
                                        data_parallel=devices // trainer_mp, devices_per_replica=trainer_mp,
                                        packing=True), model)
