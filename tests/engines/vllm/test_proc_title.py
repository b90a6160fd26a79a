"""What a vLLM worker shows while it applies a weight version (``worker_extension``), read as ``ps`` reads it."""

import subprocess
import sys

from asyncflow.engines.vllm.worker_extension import _announce_pause

CHILD = """
from pathlib import Path
from asyncflow.engines.vllm.worker_extension import _ProcTitle

def title():
    return Path("/proc/self/cmdline").read_bytes().replace(b"\\0", b" ").decode(errors="replace")

applying = _ProcTitle("applying weight version 3")
during = title()
applying.restore()
print(repr(during))
print(repr(title()))
"""


def test_title_shows_the_version_while_applying_and_is_restored():
    # A process of its own, as a vLLM worker is: the title is the whole process's, not this test's to change.
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    during, after = (eval(line) for line in out.stdout.splitlines())  # noqa: S307 - repr of two strings we printed
    assert during.rstrip().endswith("[asyncflow: applying weight version 3]"), during
    assert "[asyncflow:" not in after, after


def test_the_fault_injection_hold_is_announced_with_pid_and_version(tmp_path, monkeypatch):
    import os

    path = tmp_path / "paused"
    monkeypatch.setenv("ASYNCFLOW_APPLY_PAUSE_FILE", str(path))
    _announce_pause(7)
    _announce_pause(8)
    assert path.read_text() == f"{os.getpid()} 7\n{os.getpid()} 8\n"
    monkeypatch.delenv("ASYNCFLOW_APPLY_PAUSE_FILE")
    _announce_pause(9)  # unset, as in every real run: nothing is written
    assert path.read_text().count("\n") == 2
