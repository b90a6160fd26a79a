"""``bench/e2e.py``'s CPU accounting: the machine's busy CPU over a run's steady steps, per sample, and the ceiling
it puts on a mode's ratio to sync. The runs themselves take minutes (docs/benchmarks.md); the figures here are
made up, and the sampler is read against a busy loop of known length."""

import json
import time

import pytest

from bench.e2e import MachineCpu, paired, steady_cpu


def _metrics(path, ends, rows):
    path.write_text("".join(json.dumps({"step": i, "time/elapsed_s": t, "actor/rows": r}) + "\n"
                            for i, (t, r) in enumerate(zip(ends, rows))))
    return path


def test_steady_cpu_reads_the_steady_steps_on_the_wall_clock(tmp_path):
    cpu = MachineCpu.__new__(MachineCpu)  # samples given, no thread: 1.5 busy cores from t=1000
    cpu.samples = [(1000.0 + t, 1.5 * t) for t in range(0, 21)]
    metrics = _metrics(tmp_path / "metrics.jsonl", [1.0, 2.0, 4.0, 6.0, 10.0], [32, 32, 32, 32, 32])
    got = steady_cpu({"started_unix_s": 1003.5}, metrics, cpu)  # steady: elapsed 2 -> 10, 96 rows
    assert got["cores_busy"] == pytest.approx(1.5)
    assert got["cpu_ms_per_sample"] == pytest.approx(1e3 * 1.5 * 8 / 96)
    assert cpu.busy_s(1003.25, 1004.75) == pytest.approx(1.5 * 1.5)  # between samples: interpolated
    assert cpu.busy_s(990.0, 1005.0) != cpu.busy_s(990.0, 1005.0)  # before the first sample: NaN


def test_the_sampler_sees_a_busy_core():
    cpu = MachineCpu(interval=0.05)
    start = time.time()
    while time.time() - start < 0.6:  # one core busy for 0.6 s
        pass
    end = time.time()
    time.sleep(0.1)
    cpu.stop()
    assert 0.4 < cpu.busy_s(start + 0.05, end - 0.05) / (end - start - 0.1) <= cpu.cores + 0.1


def test_paired_gives_cpu_per_sample_and_the_ceiling():
    run = {"sync": (100.0, 15.0), "stream": (120.0, 16.0)}  # steady samples/s, CPU ms per sample
    results = {f"heavy_{mode}#{i}": {"steady_samples_per_s": rate * speed, "cpu_ms_per_sample": ms}
               for i, speed in ((1, 1.0), (2, 0.9)) for mode, (rate, ms) in run.items()}
    lines = paired(results, cores=2).splitlines()
    assert lines[0].endswith("| ceiling on 2 busy cores, x sync (median) |")
    # sync: 2 cores / 15 ms = 133.3 samples/s against its own 100 and 90: 1.33x and 1.48x.
    assert lines[2] == "| heavy_sync | - | 1.00x | 1.00x | 1.41x |"
    # stream: 1.2x in both repeats, 16/15 the CPU; 2 cores / 16 ms = 125 samples/s against 100 and 90.
    assert lines[3] == "| heavy_stream | 1.20x, 1.20x | 1.20x | 1.07x | 1.32x |"
