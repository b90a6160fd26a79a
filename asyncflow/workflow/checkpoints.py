"""Crash-safe checkpoint folders for ``asyncflow train --resume``.

Layout under ``root``::

    step_000012.tmp/      staging: components (actor/, critic/, ...) write here; ignored by readers
    step_000012/          final: the components' folders, meta.json and a COMPLETE marker
    latest                text file naming the newest committed folder (a hint; see ``latest()``)

A checkpoint counts only once its folder has the final name *and* holds ``COMPLETE``. Both are
reached by steps that are atomic on POSIX file systems (``os.replace``) and made durable by fsync, so
a process killed at any point leaves the previous checkpoint loadable. One process (the driver)
owns the manager; components on other processes only write into the path ``staging`` returned, and
must have finished (their collective save returned) before the driver calls ``commit``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

COMPLETE = "COMPLETE"
META = "meta.json"
LATEST = "latest"
_FINAL = re.compile(r"step_(\d+)")
_STAGING = re.compile(r"step_(\d+)\.tmp")
_REPLACED = re.compile(r"step_(\d+)\.replaced")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be committed or read."""


class CheckpointManager:
    """Stages, commits, finds and prunes the checkpoints of one run under ``root``.

    ``keep_last`` is how many complete checkpoints survive pruning (the newest by step; <= 0 keeps
    all). The one just committed is never pruned.
    """

    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)

    def step_dir(self, step: int) -> Path:
        """The final folder of ``step`` (whether or not it exists)."""
        return self.root / f"step_{step:06d}"

    def staging(self, step: int) -> Path:
        """A fresh, empty staging folder for ``step``; components write their parts into it.

        A staging folder left by a crashed attempt at the same step is removed first: its content
        may be half written.
        """
        tmp = self._staging_dir(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, meta: dict) -> Path:
        """Seal the staging folder of ``step`` as a complete checkpoint and return its final path.

        ``meta`` must be plain JSON; by convention it holds ``weight_version``, ``data`` (the data
        cursor) and ``extra``; ``step`` is added. Afterwards ``latest`` names this checkpoint and
        older ones beyond ``keep_last`` are deleted.
        """
        tmp = self._staging_dir(step)
        if not tmp.is_dir():
            raise CheckpointError(f"no staging folder {tmp}: call staging({step}) first")
        if meta.get("step", step) != step:
            raise CheckpointError(f"meta says step {meta['step']} but committing step {step}")
        # Serialize first, so that a meta that is not plain JSON fails before anything is written.
        text = json.dumps({**meta, "step": step}, indent=2, sort_keys=True)
        # Components' writers (Megatron's among them) do not fsync; a power loss after the rename
        # could otherwise leave a COMPLETE folder with empty files.
        _fsync_tree(tmp)
        _write_durable(tmp / META, text)
        _write_durable(tmp / COMPLETE, "")
        _fsync_dir(tmp)

        final = self.step_dir(step)
        if final.exists():
            # A re-run of this step: os.replace cannot overwrite a non-empty folder, so move the old
            # one aside (it stays complete until the new one is in place) and drop it afterwards.
            aside = self.root / f"{final.name}.replaced"
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._point_latest(final)
        self._prune(step)
        return final

    def latest(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint as ``(folder, meta)``, or None if there is none.

        Trusts the ``latest`` pointer when it names a complete folder; otherwise (pointer missing,
        or naming a folder that was deleted or never finished) scans for the highest complete step.
        Folders whose meta.json is unreadable are skipped with a warning.
        """
        pointer = self.root / LATEST
        name = pointer.read_text().strip() if pointer.is_file() else ""
        if _FINAL.fullmatch(name):
            meta = self._read_meta(self.root / name)
            if meta is not None:
                return self.root / name, meta
        for step in sorted(self._final_steps(), reverse=True):
            if self.step_dir(step).name == name:
                continue  # already tried (and warned about) through the pointer
            meta = self._read_meta(self.step_dir(step))
            if meta is not None:
                return self.step_dir(step), meta
        return None

    def list(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(s for s in self._final_steps() if (self.step_dir(s) / COMPLETE).is_file())

    # ------------------------------------------------------------------ internals
    def _staging_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}.tmp"

    def _final_steps(self) -> list[int]:
        return [int(m.group(1)) for p in self.root.iterdir() if p.is_dir() and (m := _FINAL.fullmatch(p.name))]

    def _read_meta(self, folder: Path) -> dict | None:
        """meta.json of a complete folder; None (with a warning if it is corrupt) otherwise."""
        if not (folder / COMPLETE).is_file():
            return None
        try:
            meta = json.loads((folder / META).read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            warnings.warn(f"skipping checkpoint {folder}: unreadable {META} ({exc})", stacklevel=3)
            return None
        return meta

    def _point_latest(self, final: Path) -> None:
        tmp = self.root / f"{LATEST}.tmp"
        _write_durable(tmp, final.name + "\n")
        os.replace(tmp, self.root / LATEST)
        _fsync_dir(self.root)

    def _prune(self, committed: int) -> None:
        complete = self.list()
        keep = set(complete if self.keep_last <= 0 else complete[-self.keep_last :]) | {committed}
        for step in self._final_steps():
            folder = self.step_dir(step)
            if step in keep:
                continue
            if step in complete or step < committed:  # incomplete folders of newer steps are not ours
                _remove(folder)
        for path in self.root.iterdir():
            staged = _STAGING.fullmatch(path.name)
            # A newer step's staging folder may belong to a writer that is still running.
            if (staged and int(staged.group(1)) < committed) or _REPLACED.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder so that a crash midway never leaves a partial one marked complete."""
    marker = folder / COMPLETE
    if marker.exists():
        marker.unlink()
        _fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # A rename or a new entry is durable only once the folder holding it is fsynced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))
