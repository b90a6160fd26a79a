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
        self.root = checkpoint_root(cfg)
        self.manager = CheckpointManager(self.root, cfg.checkpoint.keep_last)
        self.cursors: dict[int, tuple[dict, int]] = {}  # step -> (cursor before its first prompts, draw index)
        self.draws: list[tuple[int, int, bool]] = []  # every (step, count, first round) drawn, in order
        self.draws_offset = 0  # draws before this index were pruned
        # More of the run's state for its checkpoints: ``extra(trained_groups) -> dict`` (the sample stream's
        # prompts not trained yet, ``workflow.feeder.StreamFeeder``).
        self.extra = None
        if self.interval > 0 and not hasattr(source, "state_dict"):
            raise TypeError(f"prompt source {type(source).__name__} has no state_dict(): checkpoints need the "
                            "data cursor (add state_dict/load_state_dict, or set checkpoint.interval=0)")

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
        if self.interval > 0 and step not in self.cursors:
            self.cursors[step] = (self.source.state_dict(), self.draws_offset + len(self.draws))

    def log_draw(self, step: int, count: int, first: bool) -> None:
        """``count`` prompts were drawn for ``step`` (its first round or a top-up)."""
        if self.interval > 0:
            self.draws.append((step, count, first))

    def step_done(self, step: int, trained_groups: dict[int, list[int]]) -> Path | None:
        """Step ``step`` is complete (all its reports are in): commit its checkpoint when one is due."""
        trained = step + 1
        if not checkpoint_due(trained, self.interval, self.steps):
            return None
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
