"""``bench/e2e.py``'s CPU accounting: the machine's busy CPU over a run's steady steps, per sample, and the ceiling
it puts on a mode's ratio to sync. The runs themselves take minutes (docs/benchmarks.md); the figures here are
made up, and the sampler is read against a busy loop of known length."""

import json
import time

import pytest

from bench.e2e import PROCESSES, MachineCpu, _process_group, by_process, paired, steady_cpu


def _metrics(path, ends, rows):
    path.write_text("".join(json.dumps({"step": i, "time/elapsed_s": t, "actor/rows": r}) + "\n"
                            for i, (t, r) in enumerate(zip(ends, rows))))
    return path


def test_steady_cpu_reads_the_steady_steps_on_the_wall_clock(tmp_path):
    cpu = MachineCpu.__new__(MachineCpu)  # samples given, no thread: 1.5 busy cores from t=1000, one of them rollout's
    cpu.samples = [(1000.0 + t, 1.5 * t) for t in range(0, 21)]
    cpu.procs = [{7: ("RolloutService", 1.0 * t), 8: ("VersionBoard", 0.1 * t)} for t in range(0, 21)]
    for t in range(8, 21):  # the actor starts at t=8, inside the window: counted from 0
        cpu.procs[t][9] = ("ActorService", 0.5 * (t - 8))
    metrics = _metrics(tmp_path / "metrics.jsonl", [1.0, 2.0, 4.0, 6.0, 10.0], [32, 32, 32, 32, 32])
    got = steady_cpu({"started_unix_s": 1003.5}, metrics, cpu)  # steady: elapsed 2 -> 10, 96 rows
    assert got["cores_busy"] == pytest.approx(1.5)
    assert got["cpu_ms_per_sample"] == pytest.approx(1e3 * 1.5 * 8 / 96)
    by = got["cpu_ms_by_process"]
    assert by["RolloutService"] == pytest.approx(1e3 * 8 / 96)  # samples 1006..1013 inside, scaled to 8 s
    assert by["VersionBoard"] == pytest.approx(1e3 * 0.1 * 8 / 96)
    assert by["ActorService"] == pytest.approx(1e3 * 0.5 * 5 * 8 / 7 / 96)  # 2.5 s over the samples 1006..1013
    assert by["ReferenceService"] == 0.0 and sum(by.values()) == pytest.approx(got["cpu_ms_per_sample"])
    assert cpu.busy_s(1003.25, 1004.75) == pytest.approx(1.5 * 1.5)  # between samples: interpolated
    assert cpu.busy_s(990.0, 1005.0) != cpu.busy_s(990.0, 1005.0)  # before the first sample: NaN


def test_processes_are_told_apart_by_ray_title_and_command_line():
    import os
    from types import SimpleNamespace

    def proc(cmdline, pid=1, name="python"):
        return SimpleNamespace(pid=pid, info={"name": name, "cmdline": cmdline})

    assert _process_group(proc(["ray::RolloutService.run", ""])) == "RolloutService"
    assert _process_group(proc(["ray::ReferenceService"])) == "ReferenceService"
    assert _process_group(proc(["ray::RewardService.run"])) is None  # the rest
    assert _process_group(proc(["python", "-m", "asyncflow.transfer_queue.server"])) == "TransferQueue"
    assert _process_group(proc(None, name="raylet")) is None
    assert _process_group(proc(["python", "bench/e2e.py"], pid=os.getpid())) == "driver"


def test_the_sampler_sees_a_busy_core():
    cpu = MachineCpu(interval=0.05)
    while len(cpu.samples) < 2:  # the sampler has begun
        time.sleep(0.01)
    start = time.time()
    while time.time() - start < 0.6:  # one core busy for 0.6 s
        pass
    end = time.time()
    time.sleep(0.3)
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


def test_by_process_gives_each_modes_median():
    runs = {f"heavy_stream#{i}": {"cpu_ms_per_sample": total, "cpu_ms_by_process": {
        **{p: 0.0 for p in PROCESSES}, "RolloutService": roll, "rest": total - roll}}
        for i, (total, roll) in enumerate([(10.0, 4.0), (12.0, 5.0), (20.0, 9.0)], 1)}
    lines = by_process(runs).splitlines()
    assert lines[0] == "| mode | CPU ms / sample | " + " | ".join([*PROCESSES, "rest"]) + " |"
    assert lines[2] == "| heavy_stream | 12.00 | 5.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 7.00 |"
