"""Chaos benchmark: one training run with faults injected at random times, and the throughput with one of two
rollout instances dead next to the healthy run's.

    python bench/chaos.py [--faults 10] [--steps 300] [--seed 0] [--out DIR] [--rate-steps 16] [--cost-steps 40]
                          [--host-steps 12] [--host-rollout-steps 40] [--restart-timeout 10]
                          [--mode all|rollout-cost|host|host-rollout] [--spares 1] [--cost-repeats 3]
                          [--token-s 0.02]

The workflow runs on the fake engines (``asyncflow.engines.fake``: the models are a table; Ray, its actor
processes, the TransferQueue's server processes, the version board, the driver and its run checkpoints are real),
as ``asyncflow train`` subprocesses on this one host: GRPO on the add-one task, async, max_staleness 1, two rollout
instances, a checkpoint every step. Rollout is the slow side on purpose (``ASYNCFLOW_FAKE_TOKEN_S``, ``--token-s``:
a fixed time per engine step, a sleep), so that the throughput comparison measures the rollout instances.

Faults, in turn, each at a random time once the run has logged a step since the previous one:

- ``rollout``: SIGKILL of one rollout instance's process (picked at random). The supervisor restarts it.
- ``reward``: SIGKILL of the reward worker's process. The supervisor restarts it.
- ``trainer``: SIGKILL of the actor rank's process. The driver tears the run down and starts it again from its
  newest checkpoint in the same process (``workflow.max_restarts``); detected when it records the restart,
  recovered once the restarted run logged a step past the last one logged before the death.
- ``storage``: SIGKILL of one TransferQueue storage unit. The rows on it are lost: when a step still needs one of
  them the driver restarts the run from its newest checkpoint, as for a trainer death; otherwise it goes on
  without the unit (``survived``).
- ``driver``: SIGTERM of the driver. It checkpoints at the next step boundary and exits 75; it is resumed.
- ``host`` (a run of its own, where the two-host cluster of ``tools/two_host.py`` can be made: root, network
  namespaces): SIGKILL of every process of host B (its Ray node, its workers, its TransferQueue storage units)
  mid-run (``host_fault``). What died with it is handled as its kind is: services restarted, rows lost with a storage
  unit restart the run from its checkpoint. Its row says what ran on host B.
- ``host-rollout`` (a run of its own on the two-host cluster, ``host_rollout_fault``): host B runs one of the two
  rollout instances (its weights come through the relay) and nothing else of the run; SIGKILL of every process of
  host B. The run goes on with host A's instance, which takes the dead one's rows; the dead one cannot be placed
  again and is left out after ``workflow.restart_timeout_s``. Its row adds the samples/s before the kill and after
  the death, and the run's shared-memory segments left on host A.

Per fault: ``detected s`` (restarts: the driver saw the death; storage: the driver reported the unit gone; run
stops: the driver exited), ``recovered s``
(restarts: the worker answered again and its rows were handed out again; run stops: the resumed run logged a step
past the last one logged before it stopped), ``steps redone`` (steps logged before the stop that the resumed run
trained again: it resumes at its newest checkpoint), and samples ``lost / twice / corrupted`` among the steps in
flight at the fault (the step after the last one logged and the ``max_staleness + 2`` after it: the steps whose rows
can be held anywhere): from the final summary's record of the groups each step trained (the whole run's, resumed
segments included). Lost: a sample of those steps never trained; twice: trained more than once; corrupted: trained
in another step than its own or in a group of the wrong size. The staleness bound is checked over the last segment's
steps.

The throughput rows are two runs of ``--rate-steps`` steps without checkpoints: both instances healthy, and one
whose rollout instance is killed twice at its first step with ``workflow.max_service_restarts=1`` (restarted once,
then left out: the run ends on the other instance). Rates are samples/s over the steps logged after the
instance was left out, and over the same steps of the healthy run. Fake rollout instances sleep instead of
computing, so the two share this machine's cores without slowing each other: real engines on a host of two cores
would not.

The cost of a rollout instance's death (``--mode rollout-cost``, and in ``all``): two runs of ``--cost-steps``
steps without checkpoints, one healthy and one whose rollout instance is SIGKILLed once (restarted) once a third of
the steps are logged, same seed. The extra wall time is the killed run's time from the step logged at the kill to
its last step minus the healthy run's time over the same steps; the regeneration time is the rows the driver
handed out again times the generation time per row (the rollout instances' ``generate`` spans of the killed run:
seconds over rows). The issue's target is a ratio below 2. The difference of two runs' wall times also holds their
difference of pace (a run's steps may all be a few ms slower on a shared machine, as much over the steps after the
kill as the death costs), so the table also gives each run's time over those steps beyond its own median step time
before the kill (steps 4 to the kill), killed minus healthy, and its ratio. The same pair runs again with
``--spares`` warm spare rollout instances (``workflow.rollout_spares``): the killed instance's slot is taken by a
spare instead of a restarted process, and the healthy run shows what an idle spare costs. ``--cost-repeats``
pairs of each (interleaved, seeds ``--seed`` + repeat); the table gives their medians and every ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, K = 8, 4, 1
FAKE = ["trainer.engine=asyncflow.engines.fake.FakeTrainEngine",
        "critic.engine=asyncflow.engines.fake.FakeCriticEngine",
        "rollout.engine=asyncflow.engines.fake.FakeRolloutEngine", "trainer.lr=0.05", "observability.tensorboard=false"]
BASE = [*FAKE, f"workflow.prompts_per_step={PROMPTS}", f"workflow.samples_per_prompt={GROUP}",
        f"workflow.max_staleness={K}", "workflow.rollout_chunk=4", "workflow.score_chunk=8",
        "trainer.micro_batch_size=8", "algorithm.kl_coef=0", "workflow.rollout_instances=2"]
ENV = {"ASYNCFLOW_FAKE_TOKEN_S": "0.02"}
KINDS = ["rollout", "reward", "trainer", "storage", "reward", "rollout", "driver", "trainer", "rollout", "reward"]


class Run:
    """``asyncflow train`` segments of one run (the first, then ``--resume`` after each stop)."""

    def __init__(self, out: Path, model: Path, steps: int, extra: list[str], env: dict | None = None):
        self.out, self.steps, self.env = out, steps, env
        self.args = [str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), f"model.path={model}",
                     f"observability.output_dir={out}", f"workflow.steps={steps}", *BASE, *extra]
        self.proc: subprocess.Popen | None = None
        self.segments = 0

    def start(self, resume: bool = False) -> None:
        env = dict(self.env or os.environ, **ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        log = open(self.out.parent / f"{self.out.name}.segment{self.segments}.log", "w")
        self.segments += 1
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", *self.args,
                                      *(["--resume"] if resume else [])], cwd=self.out.parent, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def log_text(self) -> str:
        """What the current segment printed so far."""
        log = self.out.parent / f"{self.out.name}.segment{self.segments - 1}.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def resumed_from(self) -> int | None:
        """The step the current segment resumed at (from its log line), None before it says."""
        match = re.search(r"resume: continuing from .* \(step (\d+),", self.log_text())
        return int(match.group(1)) if match else None

    def logged(self) -> list[dict]:
        """The metrics records of the steps logged so far (a resumed run trims them to its checkpoint)."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]

    def last_step(self) -> int:
        steps = [r["step"] for r in self.logged()]
        return max(steps) if steps else -1

    def restarts(self) -> list[dict]:
        path = self.out / "restarts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def tree_pids(self) -> list[int]:
        """The driver's pid and its live descendants' (the TransferQueue servers, a local Ray's workers)."""
        try:
            return [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))]
        except psutil.Error:
            return []

    def workers(self, what: str) -> list[psutil.Process]:
        """The run's live processes of a kind: ``RolloutService`` / ``RewardService`` actors, or storage units."""
        procs = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if what == "storage" and "asyncflow.transfer_queue._server" in cmd:
                procs.append(child)
            elif cmd.startswith(f"ray::{what}"):
                procs.append(child)
        if what == "storage":  # the first server started is the controller
            procs = sorted(procs, key=lambda p: p.pid)[1:]
        return procs


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return None


def inject(run: Run, kind: str, rng: random.Random) -> dict:
    """Inject one fault of ``kind`` now; return its record once the run has recovered from it."""
    at = run.last_step()
    seen = len(run.restarts())
    started = run.log_text().count("first step done")
    t0 = time.time()
    if kind == "driver":
        os.kill(run.proc.pid, signal.SIGTERM)
    else:
        name = {"rollout": "RolloutService", "reward": "RewardService", "storage": "storage",
                "trainer": "ActorService"}[kind]
        procs = wait_for(lambda: run.workers(name), 30)
        if not procs:
            return {"kind": kind, "at_step": at, "error": "no such process"}
        os.kill(rng.choice(procs).pid, signal.SIGKILL)
    record = {"kind": kind, "at_step": at, "steps_redone": 0}
    if kind in ("rollout", "reward"):
        event = wait_for(lambda: run.restarts()[seen:] or (run.proc.poll() is not None), 300)
        if isinstance(event, list):
            up = event[0]["recovered_at"]  # None: still starting when the run ended
            record.update(detected_s=event[0]["detected_at"] - t0, recovered_s=None if up is None else up - t0,
                          how="restarted" if up is not None else "restart not done when the run ended")
            return record
    if kind == "trainer":
        event = wait_for(lambda: run.restarts()[seen:] or (run.proc.poll() is not None), 300)
        if isinstance(event, list):
            return restarted_from_checkpoint(run, record, event[0], started, t0)
    if kind == "storage":
        # The rows on the unit are lost. When a step still needed them the run restarts from its newest checkpoint
        # (as for a trainer death), else it goes on without the unit: detected when the driver reports the unit
        # gone, recovered once the steps in flight are trained.
        seen_log = run.log_text().count("closed its connections")
        gone = wait_for(lambda: run.log_text().count("closed its connections") > seen_log
                        or run.proc.poll() is not None, 300)
        record["detected_s"] = time.time() - t0 if gone else None
        after = wait_for(lambda: run.restarts()[seen:] or run.last_step() >= at + K + 3 or run.proc.poll() is not None,
                         600)
        if isinstance(after, list):
            return restarted_from_checkpoint(run, record, after[0], started, t0)
        if after and run.proc.poll() is None:
            record.update(recovered_s=time.time() - t0, how="survived")
            return record
    # The run stops (always for driver faults): resume it from its newest checkpoint.
    run.proc.wait(timeout=600)
    record.update(detected_s=time.time() - t0, exit_code=run.proc.returncode, how="resumed")
    last = run.last_step()  # logged before it stopped
    run.start(resume=True)
    resumed_from = wait_for(run.resumed_from, 600)
    wait_for(lambda: run.last_step() > last, 600)
    record.update(recovered_s=time.time() - t0, steps_redone=max(last + 1 - (resumed_from or 0), 0),
                  resumed_from=resumed_from)
    return record


def restarted_from_checkpoint(run: Run, record: dict, event: dict, started: int, t0: float) -> dict:
    """``record`` of a fault after which the driver restarted the run from its newest checkpoint (``event``, its
    line in ``restarts.jsonl``): recovered once the restarted run logged a step past the one it died at."""
    died, point = event["died_at_step"], event["checkpoint_step"]
    # The restarted run trims the metrics to its checkpoint and says when its first step is done.
    wait_for(lambda: run.log_text().count("first step done") > started and run.last_step() >= died
             or run.proc.poll() is not None, 600)
    recovered = time.time() - t0 if run.proc.poll() in (None, 0) else None  # None: the restarted run failed
    record.update(detected_s=event["detected_at"] - t0, recovered_s=recovered, how="restarted from checkpoint",
                  steps_redone=event["steps_redone"], resumed_from=point)
    return record


def account(summary: dict, faults: list[dict], steps: int) -> dict:
    """Per fault and in total: samples lost, trained twice and corrupted (see the module's docstring)."""
    trained = summary["trained_groups"]
    count: Counter = Counter()
    wrong: Counter = Counter()  # step -> samples in the wrong step or in a group of the wrong size
    for step, groups in trained.items():
        per_group = Counter(groups)
        for gid, n in per_group.items():
            count[gid] += n
            if gid // PROMPTS != int(step) or n % GROUP:
                wrong[int(step)] += n

    def window(first: int, last: int) -> dict:
        gids = [g for s in range(first, last + 1) for g in range(s * PROMPTS, (s + 1) * PROMPTS)]
        return {"lost": sum(max(GROUP - count[g], 0) for g in gids),
                "twice": sum(max(count[g] - GROUP, 0) for g in gids),
                "corrupted": sum(wrong[s] for s in range(first, last + 1))}

    for fault in faults:
        start = fault["at_step"] + 1
        fault.update(window(start, min(start + K + 2, steps - 1)))
    return window(0, steps - 1)


def chaos(args, model: Path) -> tuple[list[dict], dict, dict]:
    rng = random.Random(args.seed)
    run = Run(args.out / "chaos", model, args.steps, ["checkpoint.interval=1", "checkpoint.keep_last=2",
                                                        "workflow.max_service_restarts=100",
                                                        "workflow.max_restarts=100"])
    run.start()
    faults = []
    kinds = [KINDS[i % len(KINDS)] for i in range(args.faults)]
    for kind in kinds:
        # At a random time once the run has logged a step since the last fault (its pipeline is up again).
        base = run.last_step()
        if not wait_for(lambda base=base: run.last_step() > base or run.proc.poll() is not None, 600) or \
                run.proc.poll() is not None:
            break
        time.sleep(rng.uniform(0.5, 3.0))
        if run.proc.poll() is not None:
            break
        faults.append(inject(run, kind, rng))
        print(json.dumps(faults[-1]), flush=True)
    code = run.proc.wait(timeout=3600)
    summary = json.loads((run.out / "summary.json").read_text()) if code == 0 else {}
    totals = account(summary, faults, args.steps) if summary else {"error": f"the last segment exited {code}"}
    if summary:
        totals["staleness_ok"] = max(summary["lags_max_per_step"]) <= K
        totals["steps"] = len(summary["trained_groups"])
    return faults, totals, summary


def rates(logged: list[dict]) -> tuple[float, list[int]]:
    if len(logged) < 2:
        return float("nan"), []
    rows = sum(r.get("actor/rows", 0.0) for r in logged[1:])
    return rows / (logged[-1]["time/elapsed_s"] - logged[0]["time/elapsed_s"]), [r["step"] for r in logged]


def throughput(args, model: Path) -> dict:
    """Healthy vs one of two rollout instances dead, side by side."""
    healthy = Run(args.out / "healthy", model, args.rate_steps, [])
    healthy.start()
    healthy.proc.wait(timeout=1800)
    degraded = Run(args.out / "degraded", model, args.rate_steps, ["workflow.max_service_restarts=1"])
    degraded.start()
    rng = random.Random(args.seed)
    for _ in range(2):  # restarted once, then left out
        seen = len(degraded.restarts())
        procs = wait_for(lambda: degraded.last_step() >= 0 and degraded.workers("RolloutService"), 600)
        if not procs:
            break
        os.kill(rng.choice(procs).pid, signal.SIGKILL)
        wait_for(lambda seen=seen: len(degraded.restarts()) > seen or degraded.proc.poll() is not None, 300)
    degraded.proc.wait(timeout=1800)
    events = degraded.restarts()
    dropped = [e for e in events if e["error"] == "dropped"]
    if healthy.proc.returncode or degraded.proc.returncode or not dropped:
        return {"error": f"healthy exit {healthy.proc.returncode}, degraded exit {degraded.proc.returncode}, "
                         f"restarts {events}"}
    logged = degraded.logged()
    start_wall = dropped[0]["recovered_at"] - _run_start(degraded)
    after = [r for r in logged if r["time/elapsed_s"] >= start_wall]
    one, steps = rates(after)
    same = [r for r in healthy.logged() if r["step"] in steps]
    two, _ = rates(same)
    return {"healthy_samples_per_s": two, "one_dead_samples_per_s": one, "ratio": one / two if two else None,
            "steps": [steps[0], steps[-1]] if steps else []}


def _two_host(kind: str, options: dict | None = None, **sizes):
    """``tools/two_host.py`` as a module, and a cluster of ``sizes`` (``two_host.up``, with ``options`` besides)
    whose Ray nodes run the workers with the benchmark's environment; or an error record naming why none can be
    made here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("two_host", REPO / "tools/two_host.py")
    two_host = sys.modules["two_host"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
    spec.loader.exec_module(two_host)
    saved = {key: os.environ.get(key) for key in ENV}
    os.environ.update(ENV)  # the Ray nodes' workers take their environment from the nodes, not from the driver
    try:
        two_host.check_possible()
        return two_host, two_host.up(**sizes, **(options or {})), None
    except two_host.TwoHostError as exc:
        return two_host, None, {"kind": kind, "error": f"no two-host cluster here: {exc}"}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _kill_host_b(two_host, cluster) -> tuple[list[int], dict, float]:
    """SIGKILL every process in host B's network namespace; returns their pids, what they ran and the time."""
    victims = two_host._netns_pids(cluster)
    on_b = process_names(victims)
    t0 = time.time()
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims, on_b, t0


def host_fault(args, model: Path) -> tuple[dict, dict]:
    """The ``host`` fault on the two-host cluster (``tools/two_host.py``): a run over both hosts, and SIGKILL of
    every process of host B (everything in its network namespace: its Ray node, its workers, its storage units)
    once it has logged a few steps. Host B declares no device, so the trainer and the rollout instances run on
    host A (``host_rollout_fault`` puts a rollout instance on host B). The TransferQueue's storage units are Ray
    actors spread over both hosts, and the services that need no device go where Ray puts them. Returns the
    fault's record and the run's totals; ``error`` says why it could not run. ``args.cluster_options``, where set,
    are more options of ``two_host.up`` (the tests fork host A's Ray workers from a preloaded server)."""
    two_host, cluster, error = _two_host("host", getattr(args, "cluster_options", None), devices=4, cpus=8,
                                         devices_b=0)
    if error:
        return error, {}
    try:
        run = Run(args.out / "host", model, args.host_steps,
                  ["checkpoint.interval=1", "checkpoint.keep_last=2", "workflow.max_service_restarts=100",
                   "workflow.max_restarts=100", f"ray.address={cluster.address}", "ray.accelerator=NPU",
                   "ray.cpus_per_device=1", "transfer_queue.deployment=ray",
                   "transfer_queue.num_storage_units=3", "workflow.step_timeout_s=300"], env=cluster.env())
        run.start()
        if not wait_for(lambda: run.last_step() >= 2 or run.proc.poll() is not None, 900) or run.proc.poll():
            return {"kind": "host", "error": f"the run did not log 3 steps (exit {run.proc.poll()})"}, {}
        time.sleep(random.Random(args.seed).uniform(0.5, 2.0))
        at, seen, started = run.last_step(), len(run.restarts()), run.log_text().count("first step done")
        victims, on_b, t0 = _kill_host_b(two_host, cluster)
        record = {"kind": "host", "at_step": at, "steps_redone": 0, "processes": len(victims), "on_host_b": on_b}
        events = wait_for(lambda: run.restarts()[seen:] or run.proc.poll() is not None, 600)
        if isinstance(events, list):
            whole = [e for e in events if "cause" in e]  # a restart of the whole run from its checkpoint
            if whole:
                restarted_from_checkpoint(run, record, whole[0], started, t0)
                record["how"] = f"restarted from checkpoint ({whole[0]['service']} lost)"
            else:
                wait_for(lambda: run.last_step() > at + 1 or run.proc.poll() is not None, 600)
                record.update(detected_s=events[0]["detected_at"] - t0, recovered_s=time.time() - t0,
                              how=f"{events[0]['service']} restarted")
        code = run.proc.wait(timeout=3600)
        record.setdefault("how", f"stopped (exit {code})")
        if code != 0:
            record["error"] = f"the run exited {code}: {run.log_text()[-300:]}"
            return record, {}
        summary = json.loads((run.out / "summary.json").read_text())
        record["restarts"] = [e.get("cause") or e["service"] for e in run.restarts()]
        return record, account(summary, [record], args.host_steps)
    finally:
        two_host.down(cluster)


def host_rollout_fault(args, model: Path) -> tuple[dict, dict]:
    """The ``host-rollout`` fault: host A (2 devices) runs the trainer and rollout instance 0, host B (1 device)
    rollout instance 1 (``ray.rollout_label_selector``, one per instance), which reads the weights from the relay's
    mirror on host B; the TransferQueue is the driver's processes, and the light services share instance 0's
    bundle, so host B holds nothing the run cannot lose. SIGKILL of every process of host B once three steps are
    logged: the driver hands the dead instance's rows to host A's, Ray cannot start it again (host B's device is
    gone) and after ``workflow.restart_timeout_s`` it is left out; the run trains its steps on host A's instance.
    Record: detected (the driver saw the death), recovered (the run logged a step after it), ``left_out_s``, the
    samples/s before the kill and after the death, and the shared-memory segments of the run left on host A."""
    two_host, cluster, error = _two_host("host-rollout", getattr(args, "cluster_options", None), devices=2, cpus=8,
                                         devices_b=1)
    if error:
        return error, {}
    steps, bound = getattr(args, "host_rollout_steps", 40), getattr(args, "restart_timeout", 10.0)
    pids: set[int] = set()
    try:
        nodes = two_host.node_ids(cluster)
        selectors = [{"ray.io/node-id": nodes["a"]}, {"ray.io/node-id": nodes["b"]}]
        run = Run(args.out / "host_rollout", model, steps,
                  ["checkpoint.interval=1", "checkpoint.keep_last=2", "workflow.max_service_restarts=100",
                   "workflow.max_restarts=100", f"ray.address={cluster.address}", "ray.accelerator=NPU",
                   "ray.cpus_per_device=1", f"ray.rollout_label_selector={json.dumps(selectors)}",
                   "workflow.step_timeout_s=300", f"workflow.restart_timeout_s={bound}"], env=cluster.env())
        run.start()

        def logged(n: int) -> bool:  # and note the run's processes on host A (their segments are checked at the end)
            pids.update(run.tree_pids() + two_host._own_host_a_pids(cluster))
            return run.last_step() >= n or run.proc.poll() is not None

        if not wait_for(lambda: logged(2), 900) or run.proc.poll() is not None:
            return {"kind": "host-rollout", "error": f"the run did not log 3 steps (exit {run.proc.poll()})"}, {}
        time.sleep(random.Random(args.seed).uniform(0.5, 2.0))
        shm_b = sorted(cluster.in_b("ls", "/dev/shm").stdout.split())
        at, seen, started = run.last_step(), len(run.restarts()), run.log_text().count("died; starting it again")
        victims, on_b, t0 = _kill_host_b(two_host, cluster)
        seen_at = at
        record = {"kind": "host-rollout", "at_step": at, "steps_redone": 0, "processes": len(victims),
                  "on_host_b": on_b, "shm_b_before_kill": shm_b}
        if wait_for(lambda: run.log_text().count("died; starting it again") > started or run.proc.poll() is not None,
                    600) and run.proc.poll() is None:
            record["detected_s"] = time.time() - t0
            seen_at = run.last_step()
            if wait_for(lambda: logged(seen_at + 1), 600):
                record["recovered_s"] = time.time() - t0
        if wait_for(lambda: "was not started again within" in run.log_text() or run.proc.poll() is not None, 600):
            record["left_out_s"] = time.time() - t0 if "was not started again within" in run.log_text() else None
        while run.proc.poll() is None:
            logged(steps)
            time.sleep(0.2)
        record["host_b_processes_after"] = len(two_host._netns_pids(cluster))  # its /dev/shm went with them
        events = run.restarts()[seen:]
        whole = [e for e in events if "cause" in e]
        record["how"] = (f"restarted from checkpoint ({whole[0]['service']} lost)" if whole else
                         "left out" if any(e["error"] == "dropped" for e in events) else f"exit {run.proc.returncode}")
        if run.proc.returncode != 0:
            record["error"] = f"the run exited {run.proc.returncode}: {run.log_text()[-300:]}"
            return record, {}
        time.sleep(2.0)  # the run's workers on host A exit after the driver has stopped them
        mine = re.compile(r"afq-(\d+)-")
        record["shm_left_a"] = sorted(n for n in os.listdir("/dev/shm")
                                      if (m := mine.match(n)) and int(m.group(1)) in pids)
        summary = json.loads((run.out / "summary.json").read_text())
        metrics = run.logged()
        record["samples_per_s_before"], _ = rates([r for r in metrics if r["step"] <= at])
        # From the step logged when the death was seen: the steps after it were trained with host A's instance.
        record["samples_per_s_after"], after = rates([r for r in metrics if r["step"] >= seen_at])
        record["steps_after"] = [after[0], after[-1]] if after else []
        totals = account(summary, [record], steps)
        totals["staleness_ok"] = max(summary["lags_max_per_step"]) <= K
        totals["steps"] = len(summary["trained_groups"])
        return record, totals
    finally:
        two_host.down(cluster)


def process_names(pids: list[int]) -> dict[str, int]:
    """How many of ``pids`` run each program: Ray's actors by class (``ray::RewardService``), other processes by
    their executable's name (``raylet``, ``gcs_server``, ...)."""
    names: Counter = Counter()
    for pid in pids:
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0].startswith("ray::"):
            names[cmd[0].split(".")[0].split(":", 2)[-1] or cmd[0]] += 1
        elif cmd:
            names[Path(cmd[0]).name if "python" not in Path(cmd[0]).name else " ".join(cmd[1:3])] += 1
    return dict(names)


def rollout_cost(args, model: Path) -> dict:
    """What one rollout instance's death costs the run, without and with ``--spares`` warm spares: ``--cost-repeats``
    pairs of each (``cost_pair``), interleaved; their records and medians."""
    import statistics

    pairs: dict[str, list[dict]] = {"restart": [], "spare": []}
    for repeat in range(args.cost_repeats):
        for how, spares in (("restart", 0), ("spare", args.spares)):
            if how == "spare" and not spares:
                continue
            pairs[how].append(cost_pair(args, model, spares, args.seed + repeat, f"cost{repeat}_{how}"))
    medians = {}
    for how, runs in pairs.items():
        good = [r for r in runs if "error" not in r]
        if good:
            medians[how] = {key: statistics.median(r[key] for r in good if r[key] is not None)
                            for key in ("healthy_s", "killed_s", "extra_s", "detect_s", "restart_s", "released_rows",
                                        "per_row_s", "regen_s", "ratio", "paced_extra_s", "paced_ratio",
                                        "healthy_samples_per_s")
                            if any(r[key] is not None for r in good)}
    return {"steps": args.cost_steps, "spares": args.spares, "token_s": args.token_s, "pairs": pairs,
            "medians": medians}


def cost_pair(args, model: Path, spares: int, seed: int, name: str) -> dict:
    """A healthy run and a run whose rollout instance is SIGKILLed once (restarted, or replaced by a spare), same
    seed, one after the other; both with ``spares`` warm spares."""
    extra = [f"workflow.rollout_spares={spares}"] if spares else []
    healthy = Run(args.out / f"{name}_healthy", model, args.cost_steps, extra)
    healthy.start()
    healthy.proc.wait(timeout=1800)
    killed = Run(args.out / f"{name}_killed", model, args.cost_steps, extra)
    killed.start()
    rng = random.Random(seed)
    at, logged_at_kill, killed_at = args.cost_steps // 3, None, None
    if wait_for(lambda: killed.last_step() >= at or killed.proc.poll() is not None, 900) and killed.proc.poll() is None:
        time.sleep(rng.uniform(0.1, 1.0))  # a random moment inside the step: the instance holds rows in flight
        procs = running_instances(killed)
        if procs:
            logged_at_kill, killed_at = killed.last_step(), time.time()
            os.kill(rng.choice(procs).pid, signal.SIGKILL)
    killed.proc.wait(timeout=1800)
    events = [e for e in killed.restarts() if e["service"] == "rollout"]
    if healthy.proc.returncode or killed.proc.returncode or len(events) != 1 or events[0]["recovered_at"] is None:
        return {"error": f"healthy exit {healthy.proc.returncode}, killed exit {killed.proc.returncode}, "
                         f"restarts {events}"}
    spans = generate_spans(killed.out)
    per_row = sum(d for d, _ in spans) / max(sum(n for _, n in spans), 1)
    # From the step logged at the kill to the end, in both runs: the steps before it only add the load's noise.
    after = [[r for r in run.logged() if r["step"] >= logged_at_kill] for run in (healthy, killed)]
    healthy_s, killed_s = (steps_wall(logged) for logged in after)
    released = events[0]["released_rows"]
    extra_s = killed_s - healthy_s
    # The same difference with each run measured against its own pace before the kill: a run's steps may all be
    # a few ms slower than the other run's (the shared machine), which over the steps after the kill is as large as
    # the death's cost.
    paced = [over_own_pace(run.logged(), logged_at_kill) for run in (killed, healthy)]
    paced_s = None if None in paced else paced[0] - paced[1]
    # Every sample of the killed run trained once, in its step (the rows of the dead instance generated again).
    counts = account(json.loads((killed.out / "summary.json").read_text()), [], args.cost_steps)
    return {"steps": args.cost_steps, "spares": spares, "seed": seed, "killed_after_step": logged_at_kill,
            **counts,
            "healthy_s": healthy_s, "killed_s": killed_s, "extra_s": extra_s, "released_rows": released,
            "per_row_s": per_row, "regen_s": released * per_row,
            "ratio": extra_s / (released * per_row) if released and per_row else None,
            "paced_extra_s": paced_s,
            "paced_ratio": paced_s / (released * per_row) if paced_s is not None and released and per_row else None,
            "detect_s": events[0]["detected_at"] - killed_at,
            "restart_s": events[0]["recovered_at"] - events[0]["detected_at"], "how": events[0].get("how"),
            "healthy_samples_per_s": (len(after[0]) - 1) * PROMPTS * GROUP / healthy_s if healthy_s else None}


def running_instances(run: Run) -> list[psutil.Process]:
    """The run's rollout instances that run their loop now: Ray names an actor's process after the method it runs
    (``ray::RolloutService.run``); an idle spare's has its class name only."""
    procs = []
    for proc in run.workers("RolloutService"):
        try:
            if proc.cmdline()[0].startswith("ray::RolloutService.run"):
                procs.append(proc)
        except (psutil.Error, IndexError):
            continue
    return procs


def over_own_pace(logged: list[dict], at: int, warm: int = 3) -> float | None:
    """Seconds the steps after step ``at`` took beyond the run's own pace before it: their wall time minus their
    number times the median step time of steps ``warm`` to ``at`` (the first steps left out: start-up). None
    without steps on either side."""
    import statistics

    times = {r["step"]: r["time/elapsed_s"] for r in logged}
    before = [times[s] - times[s - 1] for s in range(warm + 1, at + 1) if s in times and s - 1 in times]
    after = [times[s] - times[s - 1] for s in sorted(times) if s > at and s - 1 in times]
    return sum(after) - len(after) * statistics.median(before) if before and after else None


def steps_wall(logged: list[dict]) -> float:
    """Seconds from the first of ``logged`` steps to the last (the run's start-up left out: it varies more than a
    death costs)."""
    return logged[-1]["time/elapsed_s"] - logged[0]["time/elapsed_s"] if len(logged) > 1 else float("nan")


def generate_spans(out: Path) -> list[tuple[float, int]]:
    """(seconds, rows) of every ``generate`` span of the run's rollout instances (its ``timeline.json``)."""
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    return [(e["dur"] / 1e6, e["args"]["rows"]) for e in events
            if e.get("name") == "generate" and e.get("ph") == "X" and e.get("args", {}).get("rows")]


def cost_table(cost: dict) -> str:
    """The medians of the pairs without and with spares, side by side, then every pair's ratio."""
    med = cost["medians"]
    if not med:
        return f"rollout-instance death cost: every pair failed: {json.dumps(cost['pairs'])}"
    cols = [how for how in ("restart", "spare") if how in med]
    n = {how: sum(1 for r in cost["pairs"][how] if "error" not in r) for how in cols}
    head = {"restart": "no spare (restarted)", "spare": f"{cost['spares']} warm spare(s) (promoted)"}

    def row(label: str, key: str, fmt: str) -> str:
        return f"| {label} | " + " | ".join("-" if med[h].get(key) is None else format(med[h][key], fmt)
                                            for h in cols) + " |"

    lines = [f"| rollout-instance death, fake engines ({cost.get('token_s', 0.02)} s per engine step), median of "
             "pairs | " + " | ".join(
                 f"{head[h]}, {n[h]} pair(s)" for h in cols) + " |", "|---|" + "---|" * len(cols),
             row(f"healthy run, steps from the kill (step ~{cost['steps'] // 3}) to {cost['steps'] - 1}, s",
                 "healthy_s", ".1f"),
             row("healthy run's throughput over those steps, samples/s", "healthy_samples_per_s", ".1f"),
             row("same steps, one of two instances SIGKILLed, s", "killed_s", ".1f"),
             row("extra wall time the death cost, s", "extra_s", ".2f"),
             row("SIGKILL to the driver seeing the death, s", "detect_s", ".2f"),
             row("death seen to the slot's loop running again, s", "restart_s", ".2f"),
             row("rows handed out again", "released_rows", ".0f"),
             row("generation time per row, s", "per_row_s", ".3f"),
             row("their regeneration time, s", "regen_s", ".2f"),
             row("ratio (target < 2)", "ratio", ".2f"),
             row("extra wall time, each run against its own pace before the kill, s", "paced_extra_s", ".2f"),
             row("ratio of that (target < 2)", "paced_ratio", ".2f"),
             "| samples lost / trained twice / corrupted, killed runs summed | " + " | ".join(
                 " / ".join(str(sum(r.get(k, 0) for r in cost["pairs"][h] if "error" not in r))
                            for k in ("lost", "twice", "corrupted")) for h in cols) + " |"]
    for h in cols:
        for key, what in (("ratio", "ratio"), ("paced_ratio", "ratio against each run's own pace")):
            ratios = ", ".join(_num2(r.get(key)) if "error" not in r else "failed" for r in cost["pairs"][h])
            lines.append(f"\n{head[h]}: {what} of each pair: {ratios}")
    return "\n".join(lines)


def cost_exact(cost: dict) -> bool:
    """No sample lost, trained twice or corrupted in any killed run of the rollout-cost pairs."""
    return all(not (r.get("lost") or r.get("twice") or r.get("corrupted"))
               for runs in cost["pairs"].values() for r in runs if "error" not in r)


def _num2(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _run_start(run: Run) -> float:
    """The wall-clock time the run's ``time/elapsed_s`` counts from (its summary's end minus its wall time)."""
    summary = json.loads((run.out / "summary.json").read_text())
    return (run.out / "summary.json").stat().st_mtime - summary["wall_s"]


def table(faults: list[dict], totals: dict, rates_: dict) -> str:
    lines = ["| # | fault | at step | how | detected s | recovered s | lost / twice / corrupted | steps redone |",
             "|---|---|---|---|---|---|---|---|"]
    for i, f in enumerate(faults):
        lines.append(f"| {i + 1} | SIGKILL {f['kind']}" if f["kind"] != "driver" else f"| {i + 1} | SIGTERM driver")
        lines[-1] += (f" | {f.get('at_step')} | {f.get('how', f.get('error'))} | {_num(f.get('detected_s'))}"
                      f" | {_num(f.get('recovered_s'))} | {f.get('lost')} / {f.get('twice')} / "
                      f"{f.get('corrupted')} | {f.get('steps_redone')} |")
    lines.append(f"\nwhole run: {json.dumps(totals)}")
    if "error" in rates_:
        lines.append(f"throughput: {rates_['error']}")
    else:
        lines.append("\n| rollout instances | samples/s (fake engines) |\n|---|---|\n"
                     f"| 2 healthy | {rates_['healthy_samples_per_s']:.1f} |\n"
                     f"| 1 of 2 dead | {rates_['one_dead_samples_per_s']:.1f} |\n"
                     f"| ratio | {rates_['ratio']:.2f} (steps {rates_['steps']}) |")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rate-steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-steps", type=int, default=40)
    parser.add_argument("--host-steps", type=int, default=12)
    parser.add_argument("--spares", type=int, default=1,
                        help="warm spare rollout instances of the rollout-cost pairs run with spares (0: none)")
    parser.add_argument("--cost-repeats", type=int, default=3, help="rollout-cost pairs of each kind")
    parser.add_argument("--token-s", type=float, default=0.02,
                        help="the fake rollout engines' time per engine step (ASYNCFLOW_FAKE_TOKEN_S), seconds")
    parser.add_argument("--host-rollout-steps", type=int, default=40)
    parser.add_argument("--restart-timeout", type=float, default=10.0,
                        help="workflow.restart_timeout_s of the host-rollout run")
    parser.add_argument("--mode", choices=["all", "rollout-cost", "host", "host-rollout"], default="all",
                        help="rollout-cost: only the side-by-side cost of one rollout instance's death; host: only "
                             "the loss of a whole host on the two-host cluster; host-rollout: only the loss of the "
                             "host of one of two rollout instances")
    parser.add_argument("--out", type=Path, default=Path("outputs/chaos"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    ENV["ASYNCFLOW_FAKE_TOKEN_S"] = str(args.token_s)
    from asyncflow.tiny_model import make_tiny_model

    model = args.out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model)
    if args.mode == "rollout-cost":
        cost = rollout_cost(args, model)
        (args.out / "rollout_cost.json").write_text(json.dumps(cost, indent=1))
        print(cost_table(cost))
        sys.exit(0 if cost["medians"] and cost_exact(cost) else 1)
    if args.mode in ("host", "host-rollout"):
        record, totals = (host_fault if args.mode == "host" else host_rollout_fault)(args, model)
        (args.out / f"{args.mode}.json").write_text(json.dumps({"fault": record, "totals": totals}, indent=1))
        print(table([record], totals, {"error": "not measured in this mode"}))
        sys.exit(0 if totals and not (totals["lost"] or totals["twice"] or totals["corrupted"]) else 1)
    faults, totals, _ = chaos(args, model)
    host, host_totals = host_fault(args, model)  # a run of its own, on the two-host cluster
    host_rollout, host_rollout_totals = host_rollout_fault(args, model)  # and another
    rates_ = throughput(args, model)
    cost = rollout_cost(args, model)
    report = (table([*faults, host, host_rollout], totals, rates_) + f"\nhost run: {json.dumps(host_totals)}"
              + f"\nhost-rollout run: {json.dumps(host_rollout_totals)}\n\n" + cost_table(cost))
    (args.out / "chaos.md").write_text(report + "\n")
    (args.out / "chaos.json").write_text(json.dumps({"faults": faults, "totals": totals, "host": host,
                                                     "host_totals": host_totals, "host_rollout": host_rollout,
                                                     "host_rollout_totals": host_rollout_totals, "throughput": rates_,
                                                     "rollout_cost": cost}, indent=1))
    print(report)
    ok = all(t.get(k, 0) == 0 for t in (totals, host_totals, host_rollout_totals)
             for k in ("lost", "twice", "corrupted"))
    for record, run_totals in ((host, host_totals), (host_rollout, host_rollout_totals)):  # no cluster here: skipped
        ok = ok and (bool(run_totals) or record.get("error", "").startswith("no two-host cluster"))
    sys.exit(0 if ok and cost_exact(cost) and "lost" in totals and len(faults) >= args.faults else 1)


if __name__ == "__main__":
    main()
