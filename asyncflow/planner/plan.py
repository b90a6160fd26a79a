"""``asyncflow plan RECIPE [section.key=value ...]``: does every task of a cluster recipe fit its devices?

Reads the recipe with ``asyncflow.recipes_check.load_recipe`` (and runs its checks), estimates one device of
each task with ``asyncflow.planner.memory`` (a trainer rank: its heaviest pipeline stage, with the reference
model and a critic when they share its devices; one device of a rollout engine; a reference or critic rank
when they have devices of their own), prints a table of every term in GiB against ``DEVICE_MEMORY_GB`` of
``cluster.env``, and for a task that does not fit, the smallest change that makes it fit: the fewest, mildest
of the moves below (ranked by a cost per move, ``Move``), each tried in the estimator on the same devices and
kept only if the recipe check still passes.

- trainer: distributed optimizer, sequence parallelism, selective recompute, smaller micro-batches, full
  recompute, more EP, more TP, more PP (TP, PP and EP trade against DP, so the trainer keeps its devices);
- rollout: ``gpu_memory_utilization`` 0.9, fewer ``max_num_seqs``, more rollout TP (fewer instances).

The estimates assume the cluster stack (Transformer Engine: fused attention and norms); the activation
formulas were checked on CPU against Megatron's local spec (``tests/test_plan.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from asyncflow.config import AsyncFlowConfig, ConfigError, replace_section, validate
from asyncflow.planner.memory import (
    GIB,
    Breakdown,
    TrainShape,
    reference_rank,
    relay_buffers,
    rollout_device,
    trainer_rank,
)
from asyncflow.recipes_check import Recipe, check_loaded, load_recipe


@dataclasses.dataclass
class Plan:
    """The memory plan of one recipe."""

    recipe: Recipe
    """The recipe as read (config with overrides)."""
    tasks: list[Breakdown]
    """One device of each task."""
    problems: list[str]
    """What ``asyncflow.recipes_check`` found wrong with the recipe."""
    fixes: dict[str, tuple[list[str], Breakdown] | None] = dataclasses.field(default_factory=dict)
    """For each task that does not fit: the overrides that make it fit and its new breakdown (None: no move
    tried was enough)."""

    @property
    def fits(self) -> bool:
        """Every task fits and the recipe has no problems."""
        return not self.problems and all(task.fits for task in self.tasks)


def train_shape(cfg: AsyncFlowConfig) -> TrainShape:
    """Sequence length and micro-batches per step of the recipe's trainer (the cluster stack: TE, flash)."""
    if cfg.workflow.task in ("jsonl", "parquet"):
        seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    else:
        seq = cfg.rollout.max_model_len
    tr = cfg.trainer
    rows = cfg.workflow.prompts_per_step * cfg.workflow.samples_per_prompt
    # The most loaded replica's: a packing trainer's shares differ by a row when DP does not divide the rows.
    return TrainShape(seq=seq, num_microbatches=max(1, -(-rows // (tr.micro_batch_size * tr.data_parallel))),
                      entropy=cfg.algorithm.entropy_coef > 0, reference_rows=cfg.workflow.score_chunk)


def reference_placement(cfg: AsyncFlowConfig) -> str:
    """``none`` when ``kl_coef`` is 0, else ``trainer.reference_placement``."""
    return "none" if cfg.algorithm.kl_coef == 0 else cfg.trainer.reference_placement


def estimate(recipe: Recipe) -> list[Breakdown]:
    """One device of each task of ``recipe``."""
    from asyncflow.algorithms.advantages import estimator_scope
    from asyncflow.workflow.placement import world_size

    cfg, arch = recipe.cfg, recipe.arch
    device = recipe.cluster.device_memory_gb * GIB
    shape = train_shape(cfg)
    reference = reference_placement(cfg)
    critic = cfg.critic if estimator_scope(cfg.algorithm.advantage) == "critic" else None
    shared_critic = critic if critic is not None and world_size(critic) == world_size(cfg.trainer) else None
    send, receive = relay_buffers(cfg.weight_sync, cfg.trainer)
    tasks = [trainer_rank(arch, cfg.trainer, shape, device_bytes=device,
                          reference=reference if reference != "own" else "none", critic=shared_critic,
                          relay_bytes=send)]
    tasks.append(rollout_device(arch, cfg.rollout, device_bytes=device, relay_bytes=receive))
    if reference == "own":
        tasks.append(reference_rank(arch, cfg.trainer, shape, device_bytes=device))
    if critic is not None and shared_critic is None:
        tasks.append(trainer_rank(arch, critic, dataclasses.replace(shape, entropy=False), device_bytes=device,
                                  task="critic rank", head="value"))
    return tasks


# ---------------------------------------------------------------------------------------------- fixes
def _halvings(value: int, limit: int = 3) -> list[int]:
    out = []
    while value > 1 and len(out) < limit:
        value //= 2
        out.append(value)
    return out


Move = list[tuple[float, dict]]
"""The alternatives of one move, mildest first: ``(cost, {key: value})`` (keys of the task's section, or dotted
``section.key``). Costs rank the changes: a flag that costs little speed is 1, one that recomputes or
communicates more costs more, and re-laying out the ranks costs most."""


def _trainer_moves(cfg: AsyncFlowConfig, arch) -> list[Move]:
    tr = cfg.trainer
    moves: list[Move] = []
    if not tr.use_distributed_optimizer and tr.data_parallel * tr.context_parallel > 1:
        moves.append([(1, {"use_distributed_optimizer": True})])
    if not tr.sequence_parallel and tr.tensor_parallel > 1:
        moves.append([(1, {"sequence_parallel": True})])
    recompute = [(1, {"recompute": "selective"})] if tr.recompute == "none" else []
    if tr.recompute != "full":
        recompute.append((3, {"recompute": "full", "recompute_num_layers": 1}))
    moves.append(recompute)
    moves.append([(1 + i, {"micro_batch_size": m}) for i, m in enumerate(_halvings(tr.micro_batch_size))])
    if arch.is_moe:
        moves.append([(4 + i, {"expert_parallel": tr.expert_parallel * f}) for i, f in enumerate((2, 4))])
    for cost, key in ((5, "tensor_parallel"), (6, "pipeline_parallel")):
        moves.append([(cost + i, {key: getattr(tr, key) * f, "data_parallel": tr.data_parallel // f})
                      for i, f in enumerate((2, 4)) if tr.data_parallel % f == 0])
    return [m for m in moves if m]


def _rollout_moves(cfg: AsyncFlowConfig, arch) -> list[Move]:
    ro, wf = cfg.rollout, cfg.workflow
    moves: list[Move] = []
    if ro.gpu_memory_utilization < 0.9:  # the rollout engines have their devices to themselves
        moves.append([(1, {"gpu_memory_utilization": 0.9})])
    seqs = sorted({ro.max_num_seqs * k // 8 // 8 * 8 for k in range(7, 0, -1)} - {0, ro.max_num_seqs}, reverse=True)
    moves.append([(1 + i / 2, {"max_num_seqs": n}) for i, n in enumerate(seqs)])  # 1/8 less concurrency per step
    moves.append([(5 + i, {"tensor_parallel": ro.tensor_parallel * f,
                           "workflow.rollout_instances": wf.rollout_instances // f})
                  for i, f in enumerate((2, 4)) if wf.rollout_instances % f == 0])
    return [m for m in moves if m]


def _apply(cfg: AsyncFlowConfig, section: str, changes: dict) -> AsyncFlowConfig:
    """``cfg`` with the changes of one move, checked like a loaded config (``ConfigError`` when it breaks a rule)."""
    own = {k: v for k, v in changes.items() if "." not in k}
    cfg = replace_section(cfg, section, **own)
    for dotted, value in changes.items():
        if "." in dotted:
            other, key = dotted.split(".")
            cfg = replace_section(cfg, other, **{key: value})
    validate(cfg)
    return cfg


def _overrides(section: str, changes: dict) -> list[str]:
    def text(v):
        return str(v).lower() if isinstance(v, bool) else str(v)

    return [f"{k if '.' in k else f'{section}.{k}'}={text(v)}" for k, v in changes.items()]


def find_fix(recipe: Recipe, task: str, max_moves: int = 4) -> tuple[list[str], Breakdown] | None:
    """The fewest, mildest moves that make ``task`` (``trainer rank`` or ``rollout device``) fit, as
    ``section.key=value`` overrides, with the task's new breakdown; None when no combination is enough."""
    section, moves = (("trainer", _trainer_moves(recipe.cfg, recipe.arch)) if task == "trainer rank"
                      else ("rollout", _rollout_moves(recipe.cfg, recipe.arch)))
    base_problems = set(check_loaded(recipe))
    candidates = []
    for count in range(1, min(max_moves, len(moves)) + 1):
        for combo in itertools.combinations(moves, count):
            for picks in itertools.product(*combo):
                changes = {}
                for _, change in picks:
                    changes.update(change)
                candidates.append(((sum(cost for cost, _ in picks), count), changes))
    for _, changes in sorted(candidates, key=lambda c: c[0]):  # stable: earlier moves first among equals
        try:
            cfg = _apply(recipe.cfg, section, changes)
        except ConfigError:
            continue
        trial = dataclasses.replace(recipe, cfg=cfg)
        breakdown = next(t for t in estimate(trial) if t.task == task)
        if breakdown.fits and set(check_loaded(trial)) <= base_problems:
            return _overrides(section, changes), breakdown
    return None


# ---------------------------------------------------------------------------------------------- report
def plan_recipe(recipe_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Plan:
    """Read, check and estimate the recipe; find a fix for each task that does not fit.

    Raises ``ConfigError`` when the recipe cannot be read or its ``cluster.env`` lacks ``DEVICE_MEMORY_GB``.
    """
    recipe, problems = load_recipe(recipe_dir, overrides)
    if recipe is None:
        raise ConfigError("; ".join(problems))
    if recipe.cluster.device_memory_gb is None:
        raise ConfigError(f"{recipe.name}: cluster.env has no DEVICE_MEMORY_GB (GiB per device, 80 for an H100 "
                          "80GB); the planner needs it")
    plan = Plan(recipe, estimate(recipe), check_loaded(recipe))
    for task in plan.tasks:
        if not task.fits and task.task in ("trainer rank", "rollout device"):
            plan.fixes[task.task] = find_fix(recipe, task.task)
    return plan


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def render(plan: Plan) -> str:
    """The plan as a table (GiB) with a verdict per task, then notes and fixes."""
    recipe, tasks = plan.recipe, plan.tasks
    shape = train_shape(recipe.cfg)
    lines = [f"{recipe.name}: {recipe.cluster.device_memory_gb:g} GiB per device (DEVICE_MEMORY_GB), trained rows "
             f"of {shape.seq} tokens, {shape.num_microbatches} micro-batches per step per DP rank"]
    rows = list(dict.fromkeys(k for t in tasks for k in t.terms))
    table = [["GiB per device", *(t.task for t in tasks)], ["", *(t.layout for t in tasks)]]
    table += [[row, *(_gib(t.terms[row]) if row in t.terms else "-" for t in tasks)] for row in rows]
    table.append(["total", *(_gib(t.total) for t in tasks)])
    table.append(["available", *(_gib(t.budget) for t in tasks)])
    table.append(["verdict", *("fits" if t.fits else "DOES NOT FIT" for t in tasks)])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i in (1, len(table) - 4):
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    lines.append("available: the device for Megatron ranks; rollout.gpu_memory_utilization x the device for vLLM")
    lines += [note for t in tasks for note in t.notes]
    for task, fix in plan.fixes.items():
        if fix is None:
            lines.append(f"{task}: no combination of the moves tried fits; more devices are needed")
        else:
            changes, breakdown = fix
            lines.append(f"{task}: smallest change that fits ({_gib(breakdown.total)} of {_gib(breakdown.budget)} "
                         f"GiB): {' '.join(changes)}")
    lines += [f"recipe check: {p}" for p in plan.problems]
    return "\n".join(lines)


def run(recipe_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> int:
    """Print the plan of one recipe; 0 when every task fits and the recipe check passes, else 1."""
    plan = plan_recipe(recipe_dir, overrides)
    print(render(plan))
    return 0 if plan.fits else 1
