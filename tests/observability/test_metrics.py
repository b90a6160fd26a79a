"""MetricsLogger: JSONL and TensorBoard files read back, wandb degradation, the sink registry."""

import json
import logging
import math
import sys

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncflow.config import ConfigError, load_config
from asyncflow.observability import SINKS, MetricsLogger, ObservabilityConfig, Sink, make_sink, register_sink
from asyncflow.observability.metrics import wandb_mode


def _cfg(tmp_path, **kw):
    return ObservabilityConfig(output_dir=str(tmp_path / "run"), **kw)


def test_jsonl_and_tensorboard_read_back(tmp_path):
    cfg = _cfg(tmp_path)
    with MetricsLogger(cfg, start_time=0.0) as log:
        for step in range(1, 4):
            log.log(step, {"reward/mean": 0.1 * step, "perf/samples_per_s": np.float32(8.0),
                           "loss/policy": torch.tensor(-0.5), "queue/depth": 3, "skipped": None})
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["time"] > 1e9 and r["elapsed"] == pytest.approx(r["time"]) for r in records)
    assert records[2]["reward/mean"] == pytest.approx(0.3)
    assert records[0]["loss/policy"] == -0.5 and records[0]["queue/depth"] == 3.0
    assert "skipped" not in records[0]

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "perf/samples_per_s", "loss/policy", "queue/depth"}
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([0.1, 0.2, 0.3])
    assert events[0].wall_time == pytest.approx(records[0]["time"])


def test_sinks_follow_config_and_file_restarts(tmp_path):
    cfg = _cfg(tmp_path, tensorboard=False)
    for run in range(2):
        with MetricsLogger(cfg) as log:
            assert [s.name for s in log.sinks] == ["jsonl"]
            log.log(run, {"x": 1.0})
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1  # a new run starts afresh
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_non_finite_is_strict_json_null(tmp_path):
    with MetricsLogger(_cfg(tmp_path, tensorboard=False)) as log:
        log.log(0, {"a": float("nan"), "b": math.inf, "c": 1.5})
    line = (tmp_path / "run" / "metrics.jsonl").read_text()
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert record["a"] is None and record["b"] is None and record["c"] == 1.5


def test_bad_values_and_reserved_names_raise(tmp_path):
    with MetricsLogger(_cfg(tmp_path, tensorboard=False)) as log:
        with pytest.raises(TypeError, match="'name'"):
            log.log(0, {"name": "abc"})
        with pytest.raises(ValueError, match="reserved"):
            log.log(0, {"time": 1.0})
    with pytest.raises(RuntimeError, match="after close"):
        log.log(1, {"x": 1.0})


def test_wandb_missing_warns_and_runs_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError, installed or not
    cfg = _cfg(tmp_path, tensorboard=False, wandb_project="asyncflow-test")
    with caplog.at_level(logging.WARNING, logger="asyncflow.observability.metrics"):
        with MetricsLogger(cfg) as log:
            log.log(1, {"x": 1.0})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "wandb" in warnings[0] and "pip install wandb" in warnings[0]
    assert "\n" not in warnings[0]
    assert [s.name for s in log.sinks] == ["jsonl"]
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_registry_user_sink_and_unknown_name(tmp_path):
    seen = []

    @register_sink("test_memory")
    class MemorySink(Sink):
        def write(self, step, metrics, wall_time, elapsed):
            seen.append((step, dict(metrics)))

        def close(self):
            seen.append("closed")

    try:
        cfg = _cfg(tmp_path, jsonl=False, tensorboard=False)
        with MetricsLogger(cfg, extra_sinks=["test_memory"]) as log:
            log.log(7, {"r": 2})
        assert seen == [(7, {"r": 2.0}), "closed"]
        with pytest.raises(ValueError, match="already registered"):
            register_sink("test_memory")(type("Other", (Sink,), {}))
    finally:
        SINKS.pop("test_memory")
    with pytest.raises(ValueError, match="valid sinks: jsonl, tensorboard, wandb"):
        make_sink("nope", cfg)


def test_wandb_sink_calls_the_wandb_api(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, metrics, step):
            calls.append(("log", step, metrics))

        def finish(self):
            calls.append(("finish",))

    fake = type(sys)("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = _cfg(tmp_path, jsonl=False, tensorboard=False, wandb_project="p")
    with MetricsLogger(cfg, run_config={"lr": 1e-3}) as log:
        log.log(4, {"x": 2})
    # A named project logs online, as W&B does by default (it once defaulted to offline here, silently).
    assert calls[0] == ("init", {"project": "p", "mode": "online", "dir": cfg.output_dir, "config": {"lr": 1e-3}})
    assert calls[1:] == [("log", 4, {"x": 2.0}), ("finish",)]


@pytest.mark.parametrize("configured,env,expected", [
    (None, {}, "online"),
    (None, {"WANDB_MODE": "offline"}, "offline"),
    (None, {"WANDB_MODE": "disabled"}, "disabled"),
    ("offline", {}, "offline"),
    ("online", {"WANDB_MODE": "offline"}, "online"),
], ids=["wandb-default", "env-offline", "env-disabled", "config", "config-over-env"])
def test_wandb_mode_follows_the_config_then_wandb_mode_then_online(tmp_path, configured, env, expected):
    cfg = _cfg(tmp_path, wandb_project="p", wandb_mode=configured)
    assert wandb_mode(cfg, env) == expected


def test_wandb_mode_is_one_of_wandbs_modes():
    with pytest.raises(ConfigError, match="observability.wandb_mode: expected one of"):
        load_config(None, ["observability.wandb_mode=ofline"])
    assert load_config(None, ["observability.wandb_project=p"]).observability.wandb_mode is None


def test_wandb_init_failure_warns(tmp_path, monkeypatch, caplog):
    def fail(**kw):
        raise RuntimeError("not logged in")

    fake = type(sys)("wandb")
    fake.init = fail
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with caplog.at_level(logging.WARNING):
        with MetricsLogger(_cfg(tmp_path, jsonl=False, tensorboard=False, wandb_project="p")) as log:
            log.log(1, {"x": 1})
    assert log.sinks == [] and "not logged in" in caplog.text
