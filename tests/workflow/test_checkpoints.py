"""CheckpointManager: commit, latest, pruning, and recovery from writers killed midway."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from asyncflow.workflow import checkpoints
from asyncflow.workflow.checkpoints import CheckpointError, CheckpointManager


def _save(mgr: CheckpointManager, step: int, **meta) -> None:
    stage = mgr.staging(step)
    (stage / "actor").mkdir()
    (stage / "actor" / "weights.bin").write_bytes(bytes([step % 256]) * 16)
    mgr.commit(step, {"weight_version": step, "data": {"epoch": 0, "index": step * 8}, **meta})


def test_commit_writes_layout_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    assert mgr.latest() is None and mgr.list() == []
    _save(mgr, 12, extra={"note": "x"})

    final = tmp_path / "step_000012"
    assert (final / "COMPLETE").is_file() and (final / "actor" / "weights.bin").is_file()
    assert not (tmp_path / "step_000012.tmp").exists()
    assert (tmp_path / "latest").read_text().strip() == "step_000012"
    path, meta = mgr.latest()
    assert path == final
    assert meta == {"step": 12, "weight_version": 12, "data": {"epoch": 0, "index": 96}, "extra": {"note": "x"}}
    assert json.loads((final / "meta.json").read_text()) == meta
    assert mgr.list() == [12]


def test_commit_errors_write_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(CheckpointError, match="staging"):
        mgr.commit(1, {})
    stage = mgr.staging(1)
    with pytest.raises(TypeError):  # not plain JSON
        mgr.commit(1, {"cursor": object()})
    with pytest.raises(CheckpointError, match="step 2"):
        mgr.commit(1, {"step": 2})
    assert not (stage / "COMPLETE").exists() and mgr.latest() is None


def test_keep_last_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        _save(mgr, step)
    assert mgr.list() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000005"]

    keep_all = CheckpointManager(tmp_path / "all", keep_last=0)
    for step in range(1, 6):
        _save(keep_all, step)
    assert keep_all.list() == [1, 2, 3, 4, 5]


def test_recommit_of_a_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 3, extra={"run": 1})
    _save(mgr, 3, extra={"run": 2})
    assert mgr.latest()[1]["extra"] == {"run": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]


_SLOW_WRITER = """
import sys, time
with open(sys.argv[1], "wb") as f:
    for _ in range(10_000):
        f.write(b"x" * 65536)
        f.flush()
        time.sleep(0.01)
"""


def test_writer_killed_in_staging_leaves_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    stage = mgr.staging(2)
    (stage / "actor").mkdir()
    big = stage / "actor" / "weights.bin"
    child = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(big)])
    try:
        deadline = time.monotonic() + 30
        while not (big.exists() and big.stat().st_size > 4 * 65536):  # killed mid-write, not before
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    # A fresh manager, as a restarted driver would build it.
    restarted = CheckpointManager(tmp_path, keep_last=3)
    path, meta = restarted.latest()
    assert path.name == "step_000001" and meta["step"] == 1
    assert restarted.list() == [1]
    # Retrying the step starts from an empty staging folder.
    assert list(restarted.staging(2).iterdir()) == []


def test_commit_removes_older_staging_but_not_newer(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    (mgr.staging(1) / "junk").write_text("half written")
    mgr.staging(9)  # a writer that may still be running
    _save(mgr, 5)
    assert not (tmp_path / "step_000001.tmp").exists()
    assert (tmp_path / "step_000009.tmp").is_dir()


def test_crash_before_rename_keeps_previous(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    real_replace = os.replace

    def crash_on_final_rename(src, dst):
        if str(src).endswith("step_000002.tmp"):
            raise KeyboardInterrupt("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoints.os, "replace", crash_on_final_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(mgr, 2)
    assert (tmp_path / "step_000002.tmp" / "COMPLETE").exists()  # sealed, but not under its final name
    assert mgr.latest()[0].name == "step_000001" and mgr.list() == [1]


def test_pointer_to_missing_or_incomplete_folder_falls_back_to_scan(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    _save(mgr, 1)
    _save(mgr, 2)
    _save(mgr, 3)
    shutil.rmtree(tmp_path / "step_000003")
    assert mgr.latest()[0].name == "step_000002"

    (tmp_path / "step_000002" / "COMPLETE").unlink()
    (tmp_path / "latest").write_text("step_000002\n")
    assert mgr.latest()[0].name == "step_000001"

    (tmp_path / "latest").unlink()
    assert mgr.latest()[0].name == "step_000001"
    (tmp_path / "latest").write_text("../elsewhere\n")
    assert mgr.latest()[0].name == "step_000001"


def test_corrupt_meta_is_skipped_with_a_warning(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    _save(mgr, 1)
    _save(mgr, 2)
    (tmp_path / "step_000002" / "meta.json").write_text("{not json")
    with pytest.warns(UserWarning, match="step_000002"):
        path, meta = mgr.latest()
    assert path.name == "step_000001" and meta["step"] == 1

    (tmp_path / "step_000001" / "meta.json").write_text("[1, 2]")
    with pytest.warns(UserWarning):
        assert mgr.latest() is None
