"""The suite removes the Ray session folders its local Ray instances leave (``tests.conftest.remove_ray_sessions``,
at the end of the session): the new ones nobody uses, never one that was there before or that a live process
holds."""

from __future__ import annotations

import subprocess

from tests.conftest import remove_ray_sessions


def test_new_unused_session_folders_are_removed_and_the_others_stay(tmp_path):
    root = tmp_path / "ray"
    for name in ("session_old", "session_new", "session_busy"):
        (root / name / "logs").mkdir(parents=True)
        (root / name / "logs" / "raylet.out").write_text("log")
    (root / "session_latest").symlink_to(root / "session_new")
    busy = subprocess.Popen(["sleep", "60"], cwd=root / "session_busy")  # a live process runs in it
    try:
        assert remove_ray_sessions({"session_old"}, root) == ["session_new"]
        assert sorted(p.name for p in root.iterdir()) == ["session_busy", "session_old"]  # the link pointed nowhere
    finally:
        busy.kill()
        busy.wait()
    assert remove_ray_sessions({"session_old"}, root) == ["session_busy"]
