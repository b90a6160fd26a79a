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
MIN_SHARE, MAX_SHARE = 1 / 4, 3 / 4
"""The smallest and largest share of the devices that ``mode_search`` gives rollout."""
MODE_POINTS = 12
"""At most this many splits per rollout TP in ``mode_search`` (evenly spread over the shares)."""
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
        kind = type(getattr(getattr(cfg, section), key))
        cfg = replace_section(cfg, section, **{key: value == "true" if kind is bool else kind(value)})
    return cfg


def candidate_splits(devices: int, w: Workload, trainer_mp: int, devices_per_node: int, points: int = 15
                     ) -> list[tuple[int, int, int]]:
    """``(rollout instances, rollout TP, trainer DP)`` splits of ``devices``: about ``points`` rollout shares
    per TP, trainer DP a whole number of ``trainer_mp``-device replicas (that divides the step's rows unless the
    trainer packs)."""
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
            if w.mode not in PACKED_MODES and not w.packing and w.rows_per_step % (w.micro_batch_size * dp):
                continue  # a packed trainer balances tokens: any DP size takes the step's rows
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
    """One candidate of ``mode_search``: workflow mode, rollout model, staleness and split, and its simulation."""

    rollout_model: str
    max_staleness: int
    rollout_instances: int
    rollout_tp: int
    trainer_dp: int
    result: SimResult
    workflow_mode: str = "stream"
    """``stream`` (the sample stream) or ``async`` (step-tied partitions)."""
    micro_batch_tokens: int = 0
    """The trainer's packing budget this choice sets (0: the recipe's own ``trainer.micro_batch_tokens``)."""
    problems: tuple[str, ...] = ()
    """What the recipe check says against this choice (empty: a recipe can take it as it is)."""
    extra: tuple[str, ...] = ()
    """Further overrides the split needs (``expert_overrides``)."""

    @property
    def bound(self) -> str:
        """The side that sets the pace: the trainer when it is never short of groups, else rollout."""
        return "trainer" if self.result.idle_fraction.get("actor", 0.0) < 0.05 else "rollout"

    @property
    def rollout_devices(self) -> int:
        """Devices that generate."""
        return self.rollout_instances * self.rollout_tp

    def overrides(self) -> list[str]:
        """The choice as ``section.key=value`` overrides."""
        out = [f"workflow.mode={self.workflow_mode}", f"workflow.max_staleness={self.max_staleness}",
               f"rollout.continuous={str(self.rollout_model != 'chunked').lower()}",
               f"rollout.partial={str(self.rollout_model == 'partial').lower()}",
               f"workflow.rollout_instances={self.rollout_instances}", f"rollout.tensor_parallel={self.rollout_tp}",
               f"trainer.data_parallel={self.trainer_dp}"]
        out += [f"trainer.micro_batch_tokens={self.micro_batch_tokens}"] if self.micro_batch_tokens else []
        return out + list(self.extra)


def expert_overrides(recipe, trainer_dp: int) -> list[str]:
    """An MoE recipe's expert parallelism for ``trainer_dp`` replicas: the recipe's EP, or the largest smaller one
    that divides the experts and whose grid (expert TP x EP x PP) divides the trainer's ranks; [] when unchanged
    (or dense, or no recipe)."""
    if recipe is None or not recipe.arch.is_moe:
        return []
    tr = recipe.cfg.trainer
    world = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel * trainer_dp
    fits = [ep for ep in range(tr.expert_parallel, 0, -1)
            if recipe.arch.num_experts % ep == 0 and world % (tr.tensor_parallel * ep * tr.pipeline_parallel) == 0]
    return [f"trainer.expert_parallel={fits[0]}"] if fits and fits[0] != tr.expert_parallel else []


def share_splits(devices: int, trainer_mp: int, rollout_tp: int, low: float = MIN_SHARE, high: float = MAX_SHARE,
                 points: int = MODE_POINTS) -> list[tuple[int, int]]:
    """``(rollout instances, trainer DP)`` with rollout's share of ``devices`` in ``[low, high]``: every whole
    number of trainer replicas (any DP, whether or not it divides the step's rows), at most ``points`` of them
    evenly spread; rollout takes the rest in whole engines of ``rollout_tp``."""
    out = []
    for dp in range(1, devices // trainer_mp + 1):
        instances = (devices - dp * trainer_mp) // rollout_tp
        if instances >= 1 and low - 1e-9 <= instances * rollout_tp / devices <= high + 1e-9:
            out.append((instances, dp))
    if len(out) > points:
        out = [out[round(i * (len(out) - 1) / (points - 1))] for i in range(points)]
    return sorted(set(out), key=lambda s: s[0])


def mode_search(w: Workload, model: CostModel, devices: int, trainer_mp: int, rollout_tp: int, recipe=None,
                staleness=(1, 2), models=("partial", "continuous"), progress=None, workflow_modes=("stream",),
                tp_models: dict[int, CostModel] | None = None, micro_batch_tokens: int = 0) -> list[ModeChoice]:
    """Every workflow mode of ``workflow_modes`` (``stream``, ``async``) at every rollout share of ``devices``
    (``share_splits``: a quarter to three quarters), rollout model of ``models`` (``chunked`` only in ``async``:
    the stream generates continuously), staleness bound and rollout TP (``tp_models``: a cost model per TP; else
    ``rollout_tp`` on ``model``); the ones that fit ``asyncflow plan``'s memory are simulated, best first.

    The stream's trainer packs (``stream.trainer_s``); ``async`` packs when ``w.packing`` or ``micro_batch_tokens``
    (the budget a recipe would set). With a ``recipe``, each choice carries what the recipe check says against it
    (``ModeChoice.problems``): ``recipe_best`` picks the best a recipe can take."""
    out = []
    for tp, tp_model in (tp_models or {rollout_tp: model}).items():
        for instances, dp in share_splits(devices, trainer_mp, tp):
            split, extra = Split(instances, tp, dp, True, ""), tuple(expert_overrides(recipe, dp))
            if not _memory(recipe, split.overrides() + list(extra))[0]:
                continue
            for mode, rollout_model, k in itertools.product(workflow_modes, models, staleness):
                if mode == "stream" and rollout_model == "chunked":
                    continue
                packed = mode == "stream" or w.packing or micro_batch_tokens > 0
                if not packed and w.rows_per_step % (w.micro_batch_size * dp):
                    continue  # without packing, the trainer splits a step's rows evenly over its replicas
                trial = dataclasses.replace(w, mode=mode, rollout_model=rollout_model, max_staleness=k,
                                            rollout_instances=instances, data_parallel=dp, packing=packed,
                                            fixed_shape=w.fixed_shape and not packed)
                choice = ModeChoice(rollout_model, k, instances, tp, dp, simulate(trial, tp_model), mode,
                                    micro_batch_tokens, extra=extra)
                choice.problems = tuple(recipe_problems(recipe, choice.overrides(), devices, trainer_mp))
                out.append(choice)
                if progress is not None:
                    progress(out[-1])
    return sorted(out, key=lambda c: -c.result.samples_per_s)


def recipe_problems(recipe, overrides: list[str], devices: int, trainer_mp: int) -> list[str]:
    """What ``asyncflow.recipes_check`` says against ``recipe`` with ``overrides`` and its cluster.env's device
    split moved to match them (TRAINER_DEVICES, ROLLOUT_DEVICES); [] without a recipe."""
    if recipe is None:
        return []
    from asyncflow.config import ConfigError
    from asyncflow.config_rules import problems as rules
    from asyncflow.recipes_check import Recipe, check_loaded

    try:
        cfg = _override(recipe.cfg, overrides)
        problems = rules(cfg)
    except (ConfigError, ValueError) as exc:
        return [str(exc)]
    wf, tr = cfg.workflow, cfg.trainer
    cluster = dataclasses.replace(recipe.cluster, rollout_devices=wf.rollout_instances * cfg.rollout.tensor_parallel,
                                  trainer_devices=tr.data_parallel * trainer_mp)
    moved = Recipe(recipe.name, cfg, recipe.facts, recipe.arch, cluster)
    return list(problems) + check_loaded(moved)


def recipe_best(choices: list[ModeChoice]) -> ModeChoice | None:
    """The fastest choice the recipe check accepts (``choices`` best first)."""
    return next((c for c in choices if not c.problems), None)


def colocated_baseline(w: Workload, model: CostModel, devices: int, trainer_mp: int, rollout_tp: int) -> SimResult:
    """The colocated baseline on ``devices``: every device generates (``rollout_tp`` per engine), switches
    (``CostModel.switch``), then trains (``trainer_mp`` per replica)."""
    return simulate(dataclasses.replace(w, mode="colocated", max_staleness=0, rollout_instances=devices // rollout_tp,
                                        data_parallel=devices // trainer_mp, devices_per_replica=trainer_mp,
                                        packing=True), model)
