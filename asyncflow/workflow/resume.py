"""Checkpoint and resume of a whole run, on top of ``CheckpointManager``'s crash-safe folders.

Who writes what, for a checkpoint after ``n`` trained steps (``step_n``):

- every actor rank (and critic rank) writes its Megatron distributed checkpoint, model and optimizer,
  into ``step_n.tmp/actor`` (``critic``) right after its update of step ``n - 1``, then reports;
- the driver, once every report of step ``n - 1`` is in, writes ``meta.json`` (step, weight version,
  the data cursor before step ``n``'s prompts, the trained-prompt record) and commits the folder.

A resumed run loads the newest complete checkpoint, re-creates the TransferQueue partitions from step
``n``, restores the prompt stream's cursor and replays the draws logged since it (``workflow.feeder``).
Samples generated for steps >= n before the crash are not saved: they are generated again by the
restored weights, so no prompt is trained twice and none is skipped.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from asyncflow.config import AsyncFlowConfig


def checkpoint_due(trained: int, interval: int, steps: int) -> bool:
    """Whether a checkpoint is taken once ``trained`` steps are done (every ``interval`` and at the end)."""
    return interval > 0 and trained > 0 and (trained % interval == 0 or trained == steps)


def checkpoints_on(cfg: AsyncFlowConfig) -> bool:
    """Whether the run writes periodic checkpoints (``checkpoint.interval`` or ``checkpoint.every_minutes``)."""
    return cfg.checkpoint.interval > 0 or cfg.checkpoint.every_minutes > 0


class CheckpointSchedule:
    """Which step boundaries get a checkpoint: every ``interval`` steps, the last one, and the first boundary
    reached ``every_minutes`` or more after the previous checkpoint (``clock``: seconds, monotonic).

    A clock is not the same on every process, so with ``every_minutes`` one instance, the version board's, answers
    for every trainer rank and the driver; it remembers each answer, so all of them checkpoint the same steps.
    """

    def __init__(self, interval: int, steps: int, every_minutes: float = 0.0, clock=None):
        import time

        self.interval, self.steps, self.every_s = interval, steps, max(every_minutes, 0.0) * 60.0
        self.clock = clock or time.monotonic
        self.last = self.clock()  # the previous checkpoint, or the start of this run
        self.decided: dict[int, bool] = {}

    def due(self, trained: int) -> bool:
        """Whether the boundary after ``trained`` steps gets a checkpoint (decided by the first caller)."""
        if trained not in self.decided:
            now = self.clock()
            due = checkpoint_due(trained, self.interval, self.steps) or (
                self.every_s > 0 and trained > 0 and now - self.last >= self.every_s)
            if due:
                self.last = now
            self.decided[trained] = due
        return self.decided[trained]


def ask_due(checkpoint: dict | None, board, trained: int) -> bool:
    """A checkpoint at the boundary after ``trained`` steps? ``checkpoint``: the trainers' dict (root, interval,
    steps, every_minutes). A step count decides alone; the time rule asks the version board (``board``)."""
    if not checkpoint:
        return False
    if checkpoint.get("every_minutes", 0) <= 0:
        return checkpoint_due(trained, checkpoint["interval"], checkpoint["steps"])
    import ray

    return ray.get(board.checkpoint_due.remote(trained))


def staging_path(root: str | Path, trained: int) -> Path:
    """Where components write the checkpoint after ``trained`` steps (``CheckpointManager.staging``'s name)."""
    return Path(root) / f"step_{trained:06d}.tmp"


def checkpoint_root(cfg: AsyncFlowConfig) -> Path:
    """``checkpoint.dir``, or ``checkpoints`` under the run's output directory."""
    return Path(cfg.checkpoint.dir or Path(cfg.observability.output_dir) / "checkpoints")


def trim_metrics(output_dir: str | Path, first_step: int) -> bool:
    """Drop the ``metrics.jsonl`` lines of steps >= ``first_step`` (trained again after a resume), so the
    resumed run appends a curve without repeats. Returns whether there was a file to continue."""
    import json

    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return False
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", -1) < first_step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            continue
    path.write_text("".join(line + "\n" for line in keep))
    return True


class RunCheckpoints:
    """The driver's side: data cursors per step, resume, and committing checkpoints as steps complete."""

    def __init__(self, cfg: AsyncFlowConfig, source):
        from asyncflow.workflow.checkpoints import CheckpointManager

        self.cfg, self.source = cfg, source
        self.interval, self.steps = cfg.checkpoint.interval, cfg.workflow.steps
        self.due = lambda trained: checkpoint_due(trained, self.interval, self.steps)
        """Whether the boundary after ``trained`` steps gets a checkpoint; the loop sets ``ask_due`` with the run's
        board once it exists."""
        self.root = checkpoint_root(cfg)
        self.manager = CheckpointManager(self.root, cfg.checkpoint.keep_last)
        self.cursors: dict[int, tuple[dict, int]] = {}  # step -> (cursor before its first prompts, draw index)
        self.draws: list[tuple[int, int, bool]] = []  # every (step, count, first round) drawn, in order
        self.draws_offset = 0  # draws before this index were pruned
        # More of the run's state for its checkpoints: ``extra(trained_groups) -> dict`` (the sample stream's
        # prompts not trained yet, ``workflow.feeder.StreamFeeder``).
        self.extra = None
        # A stop on a signal writes a checkpoint wherever checkpoints have a place: ``checkpoint.dir`` set, or
        # periodic ones on (``workflow.signals``); the data cursors are then kept for every step.
        periodic = checkpoints_on(cfg)
        self.enabled = periodic or (cfg.checkpoint.dir is not None and hasattr(source, "state_dict"))
        if periodic and not hasattr(source, "state_dict"):
            raise TypeError(f"prompt source {type(source).__name__} has no state_dict(): checkpoints need the "
                            "data cursor (add state_dict/load_state_dict, or set checkpoint.interval=0 and "
                            "checkpoint.every_minutes=0)")

    def resume(self) -> tuple[int, Path | None, dict]:
        """Load the newest complete checkpoint's data cursor; returns ``(first step, folder, meta)``."""
        found = self.manager.latest()
        if found is None:
            print(f"resume: no complete checkpoint under {self.root}; starting from step 0", flush=True)
            return 0, None, {}
        path, meta = found
        if meta.get("data_cursor") is not None:
            self.source.load_state_dict(meta["data_cursor"])
        print(f"resume: continuing from {path} (step {meta['step']}, weight version {meta['weight_version']})",
              flush=True)
        return int(meta["step"]), path, meta

    def clean_staging(self) -> None:
        """Remove staging folders of crashed attempts (their content may be half written)."""
        for tmp in self.root.glob("step_*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)

    def before_feed(self, step: int) -> None:
        """Remember the data cursor before the first prompts of ``step`` are drawn."""
        if self.enabled and step not in self.cursors:
            self.cursors[step] = (self.source.state_dict(), self.draws_offset + len(self.draws))

    def log_draw(self, step: int, count: int, first: bool) -> None:
        """``count`` prompts were drawn for ``step`` (its first round or a top-up)."""
        if self.enabled:
            self.draws.append((step, count, first))

    def step_done(self, step: int, trained_groups: dict[int, list[int]]) -> Path | None:
        """Step ``step`` is complete (all its reports are in): commit its checkpoint when one is due."""
        trained = step + 1
        if not self.due(trained):
            return None
        return self._commit(trained, trained_groups)

    def commit_stop(self, trained: int, trained_groups: dict[int, list[int]]) -> Path | None:
        """The run stops on a signal once ``trained`` steps are complete and the trainer groups saved their parts
        (unless a periodic checkpoint of that step was already committed): commit the checkpoint. None when
        checkpoints are off or the run trained nothing since it started (the checkpoint it resumed from stays)."""
        if not self.enabled:
            return None
        if self.due(trained) or not staging_path(self.root, trained).is_dir():
            found = self.manager.latest()
            return found[0] if found is not None and found[1].get("step") == trained else None
        return self._commit(trained, trained_groups)

    def resume_step(self) -> int | None:
        """Where ``--resume`` would continue now: the newest complete checkpoint's step (0 when there is none);
        None when checkpoints are off."""
        if not self.enabled:
            return None
        found = self.manager.latest()
        return 0 if found is None else int(found[1]["step"])

    def _commit(self, trained: int, trained_groups: dict[int, list[int]]) -> Path:
        # Not fed yet (sync mode feeds a step just before it runs): the source is exactly there now.
        cursor, index = self.cursors.get(trained) or (self.source.state_dict(), self.draws_offset + len(self.draws))
        meta = {"step": trained, "weight_version": trained, "data_cursor": cursor,
                # draws since the cursor: a resume replays them (dropping those of steps < trained)
                "replay": [list(d) for d in self.draws[index - self.draws_offset:]],
                "trained_groups": {str(k): v for k, v in sorted(trained_groups.items())}}
        if self.extra is not None:
            meta.update(self.extra(trained_groups))
        path = self.manager.commit(trained, meta)
        for old in [s for s in self.cursors if s <= trained]:
            del self.cursors[old]
        keep_from = min([i for _, i in self.cursors.values()] + [index])  # what a later checkpoint may need
        del self.draws[: keep_from - self.draws_offset]
        self.draws_offset = keep_from
        return path
