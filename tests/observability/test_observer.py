"""RunObserver: one run end to end writes every artefact and prints progress."""

import json

from asyncflow.observability import ObservabilityConfig, RunObserver, keys


def test_run_writes_everything(tmp_path, capsys):
    cfg = ObservabilityConfig(output_dir=str(tmp_path / "run"), progress_every_s=0)
    with RunObserver(cfg, total_steps=12, run_config={"seed": 0}) as obs:
        for step in range(1, 13):
            with obs.timeline.span("rollout", "generate", worker=step % 2):
                pass
            with obs.timeline.span("actor", "train_step"):
                pass
            obs.log(step, {keys.REWARD_MEAN: step / 12, keys.LAG_MAX: 1, keys.QUEUE_DEPTH: 4})
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} == {"metrics.jsonl", "tensorboard", "timeline.json", "timeline.png",
                                               "reward.png"}
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 12
    assert len([e for e in json.loads((run / "timeline.json").read_text())["traceEvents"] if e["ph"] == "X"]) == 24
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 13 and out[0].startswith("step  1/12") and out[-1].startswith("done: 12 steps")
    assert "idle rollout" in out[-1]
    assert obs.close() == []  # idempotent


def test_switches_off_and_survives_missing_reward(tmp_path, caplog):
    cfg = ObservabilityConfig(output_dir=str(tmp_path / "run"), tensorboard=False, timeline=False)
    with RunObserver(cfg) as obs:
        with obs.timeline.span("actor", "train_step"):
            pass
        obs.log(1, {"loss": 0.5})
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"metrics.jsonl"}
    assert "reward curve not written" in caplog.text
