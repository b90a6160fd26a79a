"""Runs of ``asyncflow train`` shared by several test files.

Real-stack runs (Megatron, vLLM) cost 10-20 s of start-up each on 2 cores, their workers forked from a preloaded
server (``tests.zygote``): ``demo_run`` (``tests/conftest.py``) is the demo recipe's learning run, made once per
session and read by ``tests/workflow/test_e2e.py``. Runs on the
fake engines (``asyncflow.engines.fake``) keep everything else real (Ray actors, the TransferQueue, the version
board, the services, the driver loop) and check the workflow's semantics in seconds: ``run_fake`` in pytest's own
process, through ``asyncflow.workflow.loop.train``, on the session's one local Ray (``SharedRay``, the
``shared_ray`` fixture); a test that kills the driver or watches its processes runs ``asyncflow train`` in a
subprocess instead (``train``).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, PROMPTS, GROUP = 5, 8, 4
SMALL = [f"workflow.steps={STEPS}", f"workflow.prompts_per_step={PROMPTS}", f"workflow.samples_per_prompt={GROUP}",
         "workflow.rollout_chunk=12", "workflow.score_chunk=8", "trainer.micro_batch_size=8"]
# The demo recipe's own sizes (32 prompts x 8 samples a step), 70 steps: enough to learn add-one.
LEARN_STEPS, LEARN_PROMPTS, LEARN_GROUP = 70, 32, 8

FAKE = ["trainer.engine=asyncflow.engines.fake.FakeTrainEngine",
        "critic.engine=asyncflow.engines.fake.FakeCriticEngine",
        "rollout.engine=asyncflow.engines.fake.FakeRolloutEngine",
        # The fake policy is a small table: a larger step lets it learn add-one in tens of steps.
        "trainer.lr=0.05", "critic.lr=0.05", "observability.tensorboard=false",
        # matplotlib's PNGs cost a run about as much CPU as a service's start-up; test_loop's runs still write them.
        "observability.plots=false"]
"""Overrides that put every engine of a recipe on the fakes."""


def train(cmd_args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900,
          forked: bool = False) -> subprocess.CompletedProcess:
    """``asyncflow train`` in a subprocess, with the repository on the path of the run's workers too (tests name
    their own agent loops and rewards by dotted path, as a user names theirs). ``forked``: the driver and its Ray's
    workers are forked from the session's real-stack fork server (``tests.zygote.launch_command``); not for a test
    that looks for the run's processes among the subprocess's descendants (they are the server's children)."""
    from tests import zygote

    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    forked = forked and zygote.enabled()
    command = zygote.launch_command() if forked else [sys.executable, "-m", "asyncflow.cli"]
    forks = zygote.session_server(real=True).forks() if forked else None
    proc = subprocess.run([*command, "train", *cmd_args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=env)
    if forked and proc.returncode == 0:  # else the speed-up would be gone without a word
        assert zygote.session_server(real=True).forks() > forks + 1, "the run's Ray workers were not forked"
    return proc


def _summary(out: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["_out"], summary["_stdout"] = out, proc.stdout
    return summary


def run_recipe(tmp_path, mode: str, k: int, name: str, *extra: str, sizes: list[str] = SMALL,
               forked: bool = True) -> dict:
    """``asyncflow train`` of the demo recipe at ``sizes`` (a few small steps unless given) and ``extra``; its
    workers forked from the real-stack fork server unless ``forked`` is false (see ``train``)."""
    out = tmp_path / name
    proc = train([str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), f"model.path={tmp_path / 'model'}",
                  f"observability.output_dir={out}", f"workflow.mode={mode}", f"workflow.max_staleness={k}", *sizes,
                  *extra], tmp_path, forked=forked)
    summary = _summary(out, proc)
    summary["_model_mb"] = (tmp_path / "model" / "model.safetensors").stat().st_size / 2**20
    return summary


class SharedRay:
    """One local Ray for the in-process fake runs of a pytest process (``asyncflow.workflow.loop.train`` joins the
    Ray its process is connected to and leaves it up). It declares the devices the placement tests lay out (4 NPUs,
    4 GPUs this machine does not have) and cores for one run at a time; its workers find the repository's test
    modules (agent loops and engines named by dotted path) through ``PYTHONPATH``, set before Ray starts."""

    def __init__(self):
        from tests.zygote import session_server

        self.started = False
        self.forks = session_server()

    def up(self) -> None:
        """Start it, unless this process is already connected to it. Its workers are forked from a server that
        imported what they need (``tests.zygote``)."""
        import ray

        if self.started and ray.is_initialized():
            return
        if str(REPO) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # tests/conftest.py sets it first
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.forks.start()
        with self.forks.worker_command():
            ray.init(address="local", num_cpus=4, num_gpus=4, resources={"NPU": 4}, namespace="asyncflow-tests",
                     include_dashboard=False, log_to_driver=False)
        self.started = True

    def down(self) -> None:
        """Shut it down (before a test that starts a Ray of its own in this process)."""
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
        self.started = False

    def close(self) -> None:
        """Shut it down and stop the fork servers (the session's end)."""
        from tests.zygote import stop_session_servers

        self.down()
        stop_session_servers()


def run_fake(tmp_path, model_dir, name: str, *extra: str, recipe: str = "grpo_async.yaml") -> dict:
    """A recipe of ``recipes/tiny_cpu`` on the fake engines with ``extra`` overrides, run in this process on the
    Ray it is connected to (the ``shared_ray`` fixture); its summary, with ``_out``."""
    from asyncflow.config import load_config
    from asyncflow.workflow.loop import train as train_here

    out = tmp_path / name
    cfg = load_config(REPO / "recipes/tiny_cpu" / recipe, [f"model.path={model_dir}",
                                                           f"observability.output_dir={out}", *FAKE, *extra])
    return {**train_here(cfg), "_out": out}


def bare_reporter(tmp_path, steps: int):
    """The driver's ``Reporter`` of a fake-engine config of ``steps`` steps, without a pipeline: fed reports by hand
    (``service_report``). Logging a step reads Ray's object store: use it on the tests' Ray (``shared_ray``)."""
    from types import SimpleNamespace

    from asyncflow.config import load_config
    from asyncflow.workflow.reporting import Reporter

    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml",
                      [*FAKE, f"observability.output_dir={tmp_path}", f"workflow.steps={steps}"])
    return Reporter(cfg, SimpleNamespace(groups={}, client=SimpleNamespace(status=lambda: {"live_rows": 0})))


def service_report(service: str, step: int, metrics: dict, **extra) -> dict:
    """A report as a service posts it to the version board (``TaskService.report``), without spans."""
    return {"step": step, "service": service, "worker": 0, "metrics": metrics, "spans": [], **extra}


def add_one_val_file(tmp_path, prompts: list[str]) -> Path:
    """A validation set of add-one ``prompts`` (digit strings) with their answers, as ``data.val_path`` reads it."""
    path = Path(tmp_path) / "val.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"<bos>{p}>", "ground_truth": "".join(str((int(d) + 1) % 10)
                                                                                         for d in p)}) + "\n"
                            for p in prompts))
    return path


def check_staleness_and_exactly_once(summary: dict, k: int, steps: int, prompts: int, group: int) -> None:
    """The loop's contract on a run's summary: no step trained a row more than ``k`` versions old, and every prompt
    of every step was trained once, in its own step, with its whole GRPO group (group ids are step x prompts + i)."""
    from collections import Counter

    assert summary["steps"] == steps
    assert max(summary["lags_max_per_step"]) <= k
    trained = summary["trained_groups"]
    assert sorted(map(int, trained)) == list(range(steps))
    all_groups = Counter(g for groups in trained.values() for g in groups)
    assert set(all_groups) == set(range(steps * prompts))
    assert set(all_groups.values()) == {group}
    for step, groups in trained.items():
        assert {g // prompts for g in groups} == {int(step)}


def check_stream(summary: dict, k: int, steps: int, prompts: int, group: int) -> None:
    """The sample stream's contract on a run's summary: no step trained a row more than ``k`` versions old, every
    step trained ``prompts`` whole GRPO groups, and no prompt was trained twice, in one step or in two (group ids
    count the stream's prompts, and a prompt generated again keeps its id)."""
    from collections import Counter

    assert summary["steps"] == steps
    assert max(summary["lags_max_per_step"]) <= k
    trained = summary["trained_groups"]
    assert sorted(map(int, trained)) == list(range(steps))
    rows = Counter(g for groups in trained.values() for g in groups)
    assert set(rows.values()) == {group}
    assert all(len(set(groups)) == prompts for groups in trained.values())


def records(run: dict) -> list[dict]:
    return [json.loads(line) for line in (run["_out"] / "metrics.jsonl").read_text().splitlines()]


def ray_leftovers(timeout_s: float = 60.0) -> tuple[list, list, list]:
    """What runs left in the Ray this process is connected to: actors not dead, placement groups not removed and
    TransferQueue server processes, each empty once a run that joined this Ray has closed (``ray.kill`` is
    asynchronous: waits up to ``timeout_s`` for all three to empty)."""
    import psutil
    import ray
    from ray.util import placement_group_table

    assert ray.is_initialized()
    deadline = time.monotonic() + timeout_s
    while True:
        # The public state API (ray.util.state) needs the dashboard, which the tests' Ray does not start.
        actors = [(a["ActorClassName"], a["State"]) for a in ray._private.state.actors().values()
                  if a["State"] != "DEAD"]
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        servers = [c.cmdline() for c in psutil.Process().children(recursive=True) if _is_tq_server(c)]
        if not (actors or groups or servers) or time.monotonic() > deadline:
            return actors, groups, servers
        time.sleep(0.5)


def _is_tq_server(proc) -> bool:
    import psutil

    try:
        return "asyncflow.transfer_queue._server" in " ".join(proc.cmdline())
    except psutil.Error:  # exited meanwhile
        return False
