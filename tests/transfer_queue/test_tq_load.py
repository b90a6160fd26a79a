"""``bench/tq_load.py --smoke`` end to end: producers, consumers of five tasks and every injected fault
(a consumer killed holding rows, a producer killed between prepare and commit, duplicated and delayed
requests, a storage unit killed and restarted). The bench exits 1 unless no row is lost, duplicated or
corrupted; this test also checks what each fault must have caused. Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_load_bench_smoke(tmp_path):
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "bench/tq_load.py", "--smoke", "--json", str(result)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(result.read_text())
    stream, unit = out["stream"], out["unit"]
    assert (stream["lost"], stream["duplicated"], stream["corrupted"]) == (0, 0, 0)
    assert stream["lease_expired"] >= stream["victim_took"] > 0  # the killed consumer's rows came back
    assert stream["side_live_rows"] == 0 and stream["side_rolled_back"] == 32  # the killed put rolled back
    assert unit["lost_reported"] == unit["rows_on_dead_unit"] > 0 and unit["corrupted"] == 0
    assert unit["readable_after"] > 0 and unit["units_after_restart"] == [0, 1]
    assert "get_meta p50 ms" in proc.stdout
