"""The live logprob gap's statistics and bounds (``asyncflow.observability.logprob_gap``)."""

import torch

from asyncflow.observability.logprob_gap import gap_bound, gap_problems, gap_stats, merge_stats


def test_stats_skip_unchecked_tokens_and_take_the_p99():
    gaps = torch.full((4, 50), float("nan"))
    gaps[:2] = torch.arange(100, dtype=torch.float32).reshape(2, 50) / 1000  # 0.000 .. 0.099
    stats = gap_stats([gaps[:1], gaps[1:]])
    assert stats["tokens"] == 100
    assert abs(stats["mean"] - 0.0495) < 1e-9
    assert abs(stats["p99"] - 0.098) < 1e-6 and abs(stats["max"] - 0.099) < 1e-6
    assert gap_stats(torch.full((3,), float("nan"))) == {}


def test_run_statistics_from_steps():
    steps = [{"mean": 1e-3, "p99": 2e-3, "max": 3e-3, "tokens": 100.0},
             {"mean": 3e-3, "p99": 5e-3, "max": 9e-3, "tokens": 300.0}]
    run = merge_stats(steps)
    assert abs(run["mean"] - 2.5e-3) < 1e-12 and run["p99"] == 5e-3 and run["max"] == 9e-3 and run["tokens"] == 400


def test_bounds_by_dtype():
    fine_bf16 = {"mean": 6e-4, "p99": 2e-3, "max": 0.3, "tokens": 1.0}  # one outlier: not a failure
    assert gap_problems(fine_bf16, "bfloat16") == []
    assert gap_problems(fine_bf16, "float16") == []
    assert gap_problems(fine_bf16, "float32")  # float32 engines agree to rounding
    assert gap_problems({"mean": 2e-7, "p99": 8e-7, "max": 1e-6, "tokens": 1.0}, "float32") == []
    assert "mean" in gap_problems({**fine_bf16, "mean": 0.5}, "bfloat16")[0]
    assert "no token was checked" in gap_problems({}, "float32")[0]
    assert gap_bound("float32").p99 == 1e-5
