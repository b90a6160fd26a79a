"""Plots: PNG files written, non-trivial, and from either records or a JSONL path."""

import json

import numpy as np
import pytest
from matplotlib.image import imread

from asyncflow.observability import (
    Timeline,
    load_jsonl,
    plot_compare,
    plot_compare_panels,
    plot_gantt,
    plot_reward_curve,
    rolling_mean,
)
from asyncflow.observability.plots import _series


def _records(n, slope, dt):
    rng = np.random.default_rng(0)
    return [{"step": i, "time": 1000.0 + dt * i, "elapsed": dt * (i + 1),
             "reward/mean": min(1.0, slope * i) + 0.05 * rng.standard_normal()} for i in range(n)]


def _assert_real_png(path, min_size=(300, 500)):
    img = imread(path)
    assert img.shape[0] >= min_size[0] and img.shape[1] >= min_size[1]
    # Drawn content: many distinct colours, not a blank canvas.
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 50


def test_rolling_mean_is_trailing():
    assert rolling_mean([1, 2, 3, 4], 2) == pytest.approx([1, 1.5, 2.5, 3.5])
    assert rolling_mean([5.0], 10) == pytest.approx([5.0])


def test_reward_curve_from_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(60, 0.02, 1.0)) + "\n")
    assert len(load_jsonl(path)) == 60
    out = plot_reward_curve(path, tmp_path / "plots" / "reward.png")
    _assert_real_png(out)


def test_reward_curve_missing_key_lists_keys(tmp_path):
    with pytest.raises(ValueError, match=r"keys present: \['reward/mean'\]"):
        plot_reward_curve(_records(3, 0.1, 1.0), tmp_path / "r.png", key="reward/max")


def test_compare_over_wall_time(tmp_path):
    runs = {"sync": _records(40, 0.025, 2.0), "async": _records(40, 0.025, 1.2)}
    _assert_real_png(plot_compare(runs, tmp_path / "compare.png"))
    _assert_real_png(plot_compare(runs, tmp_path / "compare_step.png", x="step", window=5))


def test_compare_panels_after_equal_samples(tmp_path):
    # Two workloads in one figure, each run against the samples it trained: 32 then 64 a step.
    runs = [{**r, "actor/rows": 32.0 if r["step"] < 10 else 64.0} for r in _records(30, 0.03, 1.0)]
    xs, _ = _series(runs, "reward/mean", "samples")
    assert xs[:2].tolist() == [32.0, 64.0] and xs[-1] == 10 * 32 + 20 * 64
    stream = [{**r, "actor/rows": 32.0} for r in _records(30, 0.02, 1.0)]
    out = plot_compare_panels({"long-tailed": {"sync": runs, "stream": stream}, "tool": {"sync": runs}},
                              tmp_path / "panels.png", x="samples")
    _assert_real_png(out, min_size=(800, 500))


def test_gantt(tmp_path):
    tl = Timeline()
    for step in range(10):
        for w in range(2):
            tl.add("rollout", "generate", step, step + 0.6 + 0.2 * w, worker=w)
        tl.add("actor", "train_step", step + 0.5, step + 0.95)
        tl.add("actor", "forward_backward", step + 0.55, step + 0.85)
    out = tl.write(tmp_path)
    assert [p.name for p in out] == ["timeline.json", "timeline.png"]
    _assert_real_png(tmp_path / "timeline.png", min_size=(200, 800))
    with pytest.raises(ValueError, match="no spans"):
        plot_gantt(Timeline(), tmp_path / "empty.png")
