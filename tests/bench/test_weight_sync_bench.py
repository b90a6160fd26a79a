"""``bench/weight_sync.py --smoke`` end to end: every method runs, the tables print, the bench's own checks hold.

The smoke preset uses tiny models (dense Qwen2 at Megatron TP2 x PP2 to vLLM TP2 here, and TP1 too when run
alone; Qwen3-MoE at EP2 to vLLM TP1), so timings mean nothing here; what is checked is that the loop's path
and the baseline both run, that vLLM's logprobs after (a) equal those after (b) for the same weights (the
bench asserts it and exits 1 otherwise), that the bytes handed to each vLLM worker are right, and that no
shared memory is left behind.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.zygote import forked_script

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ROWS = ["(a) staged", "(b) TP all-gather", "(c) memcpy", "vLLM reload_weights, whole model",
        "vLLM reload_weights, same"]


def _bench_segments() -> set[str]:
    """The bench's shared-memory segments (staging and baseline slots name its session, ``bench<pid>``)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("afq-") and "bench" in n}


def test_weight_sync_bench_smoke(tmp_path):
    result = tmp_path / "result.json"
    # One measured round per method: timings mean nothing at this size, the checks run on every method. Dense at
    # vLLM TP2 only (the resharding path; TP1 runs in the MoE table and in tests/bridge), to keep CI short.
    before = _bench_segments()
    # Forked from the tests' real-stack server, as are the processes it spawns (its ranks' forkserver, the vLLM
    # engine and its workers): each would import torch, Megatron-core or vLLM again.
    proc = forked_script(ROOT / "bench/weight_sync.py", "--smoke", "--rounds", "1", "--vllm-tp", "2",
                         "--work-dir", str(tmp_path / "work"), "--json", str(result), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}\n{err[-6000:]}"

    # One table per (workload, vLLM TP), each with every method and the ratio line.
    assert out.count("| method | trainer blocked s |") == 2
    for row in ROWS:
        assert out.count(f"| {row}") == 2, row
    assert out.count("ratios are against (b) in the same run") == 2
    assert "correctness: all checks passed" in out

    records = json.loads(result.read_text())
    assert [(r["workload"], r["vllm_tp"]) for r in records] == [("dense Qwen2", 2), ("Qwen3-MoE", 1)]
    for rec in records:
        assert all(c["ok"] for c in rec["checks"]), rec["checks"]
        a, b, total = rec["methods"]["a"], rec["methods"]["b"], rec["model_bytes"]
        # The baseline hands every worker the whole model; the loop's path only the worker's own boxes.
        assert b["bytes_per_worker"] == total
        if rec["vllm_tp"] == 1:
            assert a["bytes_per_worker"] == total
        else:
            assert a["bytes_per_worker"] < 0.6 * total
        for m in (a, b):
            for key in ("blocked", "paused", "e2e", "pack", "transport", "apply"):
                assert math.isfinite(m[key]) and m[key] >= 0, (key, m)
            assert m["e2e"] >= m["paused"] - 1e-3
            assert len(m["rss_workers"]) == rec["vllm_tp"]
        assert rec["methods"]["floor whole"]["e2e"] > 0 and rec["methods"]["memcpy"]["e2e"] > 0
    dense = [r for r in records if r["workload"].startswith("dense")]
    for rec in dense:
        assert "max |diff|" in rec["checks"][0]["line"] and "PASS" in rec["checks"][0]["line"]
        # A PASS/MISS (or n/a) line per target of the issue, with its numbers.
        assert len(rec["targets"]) == 7
        assert all(t.startswith(("- PASS", "- MISS", "- n/a", "  (")) for t in rec["targets"])
    # Every staging and baseline segment the run created was removed.
    assert not _bench_segments() - before
