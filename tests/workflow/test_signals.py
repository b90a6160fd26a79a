"""SIGTERM and SIGINT on a real ``asyncflow train`` process (fake engines; Ray, the TransferQueue, the services and
the driver are real): the run stops at a step boundary with a checkpoint there, writes summary.json, leaves no
process and no shared-memory segment behind, prints one line and exits with 75; ``--resume`` goes on from that
step and every prompt is trained exactly once over both runs (``asyncflow.workflow.signals``)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncflow.workflow.signals import EX_TEMPFAIL
from tests.recipe_runs import FAKE, REPO
from tests.workflow.processes import reap_session, session_processes

pytestmark = [pytest.mark.loop, pytest.mark.faults]

STEPS, PROMPTS, GROUP = 8, 8, 4
SIZES = [f"workflow.steps={STEPS}", f"workflow.prompts_per_step={PROMPTS}", f"workflow.samples_per_prompt={GROUP}",
         "workflow.rollout_chunk=12", "workflow.score_chunk=8", "trainer.micro_batch_size=8",
         # No reference model: one process fewer to start and to stop; the runs are stopped the same way with it.
         "algorithm.kl_coef=0"]


def _args(tmp_path: Path, model_dir, *extra: str) -> list[str]:
    return [str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), f"model.path={model_dir}",
            f"observability.output_dir={tmp_path / 'run'}", *FAKE, *SIZES, *extra]


def _logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len([line for line in path.read_text().splitlines() if line.strip()]) if path.is_file() else 0


def _shm_of(pids: set[int]) -> list[str]:
    """Shared-memory segments named after one of ``pids`` (the run's TransferQueue arenas and weight staging
    segments are ``afq-<pid>-...``)."""
    return [name for name in os.listdir("/dev/shm")
            if name.startswith("afq-") and name.split("-")[1].isdigit() and int(name.split("-")[1]) in pids]


def _stop_run(tmp_path: Path, args: list[str], signum: int, group: bool, after_steps: int = 2, train_s: str = "0.2"):
    """Start ``asyncflow train`` in a session of its own, send ``signum`` (to its whole process group, as a terminal's
    Ctrl-C does, when ``group``) once ``after_steps`` steps are logged; returns (exit status, stdout, stderr, pids
    of the run seen while it ran, processes left 30 s after it ended)."""
    env = dict(os.environ, ASYNCFLOW_FAKE_TRAIN_S=train_s)  # steps long enough for the signal to land mid-run
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids: set[int] = set()
    try:
        deadline = time.time() + 600
        while _logged_steps(tmp_path / "run") < after_steps:
            assert proc.poll() is None, "the run ended before the signal"
            assert time.time() < deadline, "no step logged within 10 minutes"
            pids.update(session_processes(proc.pid))
            time.sleep(0.1)
        pids.update(session_processes(proc.pid))
        (os.killpg if group else os.kill)(proc.pid, signum)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        leftovers = reap_session(proc.pid)
    return proc.returncode, out, err, pids, leftovers


def _startup_phases_in_order(out: str) -> None:
    """``asyncflow train`` printed its start-up phases as they happened (``observability.progress.StartupLog``)."""
    phases = [line.split("| ", 1)[1] for line in out.splitlines() if line.startswith("start-up ")]
    loading = ("rollout engines loading (FakeRolloutEngine, 1 instance(s)); trainer loading (FakeTrainEngine, "
               "1 rank(s))")
    assert {"starting Ray", "TransferQueue up", loading, "actor up", "rollout up", "first step done (step 0)"} <= \
        set(phases), phases
    at = phases.index
    assert at("starting Ray") < at("TransferQueue up") < at(loading) < min(at("actor up"), at("rollout up"))
    assert max(at("actor up"), at("rollout up")) < at("first step done (step 0)") == len(phases) - 1


def _trained_exactly_once(summary: dict) -> None:
    groups = {int(step): ids for step, ids in summary["trained_groups"].items()}
    assert sorted(groups) == list(range(STEPS))
    for step, ids in groups.items():  # one id per trained row: each prompt's group of GROUP samples, in its step
        assert ids == sorted(i for i in range(step * PROMPTS, (step + 1) * PROMPTS) for _ in range(GROUP)), step


def test_sigterm_checkpoints_at_the_step_boundary_and_resume_trains_every_prompt_once(tmp_path, tiny_model_dir):
    ckpts = tmp_path / "ckpt"
    # checkpoint.interval stays 0: the checkpoint of the stop is the only one.
    args = _args(tmp_path, tiny_model_dir, f"checkpoint.dir={ckpts}")
    status, out, err, pids, leftovers = _stop_run(tmp_path, args, signal.SIGTERM, group=False)
    assert status == EX_TEMPFAIL, out[-3000:] + err[-5000:]
    assert not leftovers, "processes of the stopped run survived it"
    assert not _shm_of(pids), "shared-memory segments of the stopped run survived it"
    assert "Traceback" not in err, err[-5000:]
    _startup_phases_in_order(out)
    lines = [line for line in out.splitlines() if line.startswith("asyncflow: stopped")]
    assert len(lines) == 1, out[-3000:]
    found = re.fullmatch(r"asyncflow: stopped at step (\d+) on SIGTERM; resume with: asyncflow train (.+)", lines[0])
    assert found, lines[0]
    step = int(found.group(1))
    assert 2 <= step < STEPS
    assert found.group(2).split()[:2] == [args[0], "--resume"] and f"checkpoint.dir={ckpts}" in found.group(2)
    # A complete checkpoint at that step, the actor's part in it.
    folder = ckpts / f"step_{step:06d}"
    assert (folder / "COMPLETE").is_file() and (folder / "actor").is_dir()
    assert json.loads((folder / "meta.json").read_text())["step"] == step
    assert (ckpts / "latest").read_text().strip() == folder.name
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"]["step"] == step and summary["stopped_early"]["signal"] == "SIGTERM"
    assert summary["stopped_early"]["checkpoint"] == str(folder) and summary["steps"] == step

    resumed = subprocess.run([sys.executable, "-m", "asyncflow.cli", "train", *args, "--resume"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                                 str(REPO), os.environ.get("PYTHONPATH")]))))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"continuing from {folder}" in resumed.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["first_step"] == step and summary["steps"] == STEPS - step
    assert summary["stopped_early"] is None
    _trained_exactly_once(summary)


def test_ctrl_c_in_sync_mode_checkpoints_between_two_periodic_checkpoints_and_prints_no_traceback(tmp_path,
                                                                                                  tiny_model_dir):
    # Sync mode (the driver runs each step's phases itself), SIGINT to the whole process group as from a terminal;
    # periodic checkpoints at steps 5 and 8 only, under the output directory (checkpoint.dir unset).
    args = _args(tmp_path, tiny_model_dir, "workflow.mode=sync", "checkpoint.interval=5")
    status, out, err, pids, leftovers = _stop_run(tmp_path, args, signal.SIGINT, group=True)
    assert status == EX_TEMPFAIL, out[-3000:] + err[-5000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-5000:]
    assert not leftovers, "processes of the stopped run survived it"
    assert not _shm_of(pids), "shared-memory segments of the stopped run survived it"
    lines = [line for line in out.splitlines() if line.startswith("asyncflow: stopped")]
    assert len(lines) == 1, out[-3000:]
    found = re.fullmatch(r"asyncflow: stopped at step (\d+) on SIGINT; resume with: asyncflow train \S+ --resume .*",
                         lines[0])
    assert found, lines[0]
    step = int(found.group(1))
    folder = tmp_path / "run" / "checkpoints" / f"step_{step:06d}"
    assert (folder / "COMPLETE").is_file() and (folder / "actor").is_dir()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"] == {"signal": "SIGINT", "step": step, "resume_step": step,
                                        "checkpoint": str(folder), "reason": None}
    assert summary["steps"] == step


def test_a_boundary_not_reached_within_the_grace_time_stops_at_once(tmp_path, tiny_model_dir):
    # Every train step takes 3 s and the grace time is 0.5 s: the signal, sent once step 0 is logged, lands in a
    # step that cannot end in time.
    # Checkpoints are off: the line says there is nothing to resume from.
    args = _args(tmp_path, tiny_model_dir, "checkpoint.signal_grace_s=0.5")
    status, out, err, pids, leftovers = _stop_run(tmp_path, args, signal.SIGTERM, group=False, after_steps=1,
                                                  train_s="3")
    assert status == EX_TEMPFAIL, out[-3000:] + err[-5000:]
    assert "Traceback" not in err, err[-5000:]
    assert not leftovers and not _shm_of(pids)
    lines = [line for line in out.splitlines() if line.startswith("asyncflow: stopped")]
    assert len(lines) == 1, out[-3000:]
    assert re.fullmatch(r"asyncflow: stopped at step \d+ on SIGTERM \(the step boundary was not reached within "
                        r"checkpoint\.signal_grace_s=0\.5 s: no checkpoint at the stop\); nothing to resume from: .*",
                        lines[0]), lines[0]
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_early"]
    assert stopped["checkpoint"] is None and stopped["resume_step"] is None and stopped["reason"]
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def test_a_second_signal_or_the_end_of_the_grace_time_stops_at_once_and_teardown_is_never_cut_short():
    from asyncflow.workflow.signals import StopNow, StopSignals

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals(grace_s=600)
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)  # the first asks for a stop at the next boundary and returns
        assert stop.requested and stop.signal_name == "SIGTERM"
        with pytest.raises(StopNow, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)  # interrupted by the handler
        stop.tearing_down()
        os.kill(os.getpid(), signal.SIGINT)  # noted, never raised
    assert signal.getsignal(signal.SIGTERM) is before

    stop = StopSignals(grace_s=0.2)
    with stop.installed(), pytest.raises(StopNow, match="signal_grace_s=0.2"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)  # the boundary never comes: the grace timer ends the wait
    stop = StopSignals(grace_s=0.2)
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)
        stop.boundary_reached()  # the checkpoint is being written: the timer no longer runs
        time.sleep(1.0)
    assert stop.requested


def test_the_stopped_line_names_the_step_and_the_resume_command():
    from asyncflow.cli import resume_command
    from asyncflow.workflow.signals import RunStopped, stopped_line

    command = resume_command("r.yaml", ["checkpoint.dir=/tmp/a b", "workflow.steps=9"])
    assert command == "asyncflow train r.yaml --resume 'checkpoint.dir=/tmp/a b' workflow.steps=9"
    assert stopped_line(RunStopped(5, "SIGTERM", 5, "/c/step_000005"), command) == \
        f"asyncflow: stopped at step 5 on SIGTERM; resume with: {command}"
    late = stopped_line(RunStopped(5, "SIGTERM", 4, reason="the step boundary was not reached"), command)
    assert late == (f"asyncflow: stopped at step 5 on SIGTERM (the step boundary was not reached); resume with: "
                    f"{command} (continues from step 4)")
    assert "nothing to resume from" in stopped_line(RunStopped(5, "SIGINT", None), command)
