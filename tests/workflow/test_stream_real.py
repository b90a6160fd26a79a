"""The sample stream on the real stack (Megatron trainer, vLLM rollout): the real engines meet the interface the
stream uses (continuous batching through ``RolloutEngine.stream``, partial rollout's weight swaps at a token
boundary under responses in flight, the trainer's data-parallel gather of trained groups) and the one a warm spare
uses (``workflow.rollout_spares``): the run's rollout instance is SIGKILLed mid-run, and the spare, a second vLLM
engine built at start-up and idle until then, takes its place (the current weights through the real weight path,
the dead instance's prompts taken back, its evaluations carried on); a new spare, a third vLLM engine, then starts
in the background. Their semantics are tested on the fake engines (``test_stream``, ``test_restart_stream``,
``test_spare``, which also covers an instance that Ray starts again), and those of the step-tied rollout modes,
which drive the same engine calls, in ``test_rollout_modes``.
"""

import json
import threading
import time

import psutil
import pytest

from tests.conftest import SHM, left_in_shm
from tests.recipe_runs import GROUP, PROMPTS, SMALL, check_stream, records, run_recipe
from tests.zygote import enabled as zygote_enabled
from tests.zygote import session_server

pytestmark = pytest.mark.slow

# The steps are short next to the run's start-up: enough of them that those after the kill need the new instance.
STEPS = 10
# Long-tailed responses on 8 engine slots: rollout is the bottleneck, so the instance killed holds prompts in its
# engine (taken back by its new incarnation), and newer weights arrive under responses in flight.
LONGTAIL = ["workflow.task=add1_longtail", "rollout.max_new_tokens=48", "rollout.max_model_len=64",
            "rollout.max_num_seqs=8"]


class RunKiller(threading.Thread):
    """SIGKILLs the rollout instance of the ``asyncflow train`` subprocess writing to ``out`` once, when
    ``ready(logged metric records)`` holds. The instance is found by the title Ray gives an actor's process running
    its loop (``ray::RolloutService.run...``; an idle spare's names its class only), made after the killer
    started, among the children of this pytest process's real-stack fork server (``tests.zygote``: the run's Ray
    forks its workers there, and the server forks only for this process's runs, one test at a time), or among the
    run's own descendants where the servers are off; so no other run on the machine is touched."""

    def __init__(self, out, ready):
        super().__init__(daemon=True)
        self.out, self.ready = out, ready
        self.killed: list[int] = []  # the instance's pid, then its descendants' (vLLM processes, if any)
        self.stop = False
        self.since = time.time()
        self.server = session_server(real=True).proc.pid if zygote_enabled() else None

    def run(self) -> None:
        metrics, instance = self.out / "metrics.jsonl", None
        while not self.stop:
            if instance is None or not instance.is_running():  # found ahead, so that the kill follows the step
                instance = self._instance()
            logged = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            if instance is not None and self.ready(logged):
                family = [instance, *instance.children(recursive=True)]
                instance.kill()
                self.killed = [p.pid for p in family]
                return
            time.sleep(0.05)

    def _instance(self):
        for worker in self._candidates():
            try:
                if " ".join(worker.cmdline()).startswith("ray::RolloutService.run") and \
                        worker.create_time() >= self.since:
                    return worker
            except psutil.Error:  # exited meanwhile
                continue
        return None

    def _candidates(self) -> list:
        if self.server is not None:
            return psutil.Process(self.server).children()
        arg = f"observability.output_dir={self.out}"
        for run in psutil.Process().children():
            try:
                if "asyncflow.cli" in run.cmdline() and arg in run.cmdline():
                    return run.children(recursive=True)
            except psutil.Error:  # exited meanwhile
                continue
        return []


def _after_the_second_evaluation(logged: list[dict]) -> bool:
    """A step after the one the second evaluation was logged with is logged: instance 0 has drained its engine for
    it and generates again, so it holds prompts."""
    evaluated = [m["step"] for m in logged if "eval/version" in m]
    return len(evaluated) >= 2 and logged[-1]["step"] > evaluated[1]


def test_stream_mode_on_vllm_and_megatron(tmp_path):
    # Partial rollout: vLLM swaps weights under responses in flight, so rows span versions and the per-token
    # bound is checked on vLLM's own token versions. With evaluation: instance 0 drains its vLLM stream, then
    # generates the validation set on the same engine (test_eval_stream has the semantics on the fake engines).
    # The one rollout instance is SIGKILLed a step after the evaluation of version 2 (or 3) is logged: the spare
    # takes its slot, applies the current weights (staged by Megatron) on its idle vLLM engine, takes back from the
    # stream the prompts the dead one held and generates them; the staleness bound and the logprob agreement with
    # Megatron below hold for those steps too, and the spare, now instance 0, evaluates next at version 4 or later
    # (not version 0 again).
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"<bos>{p}>", "ground_truth": str(int(p) + 1111)}) + "\n"
                           for p in ("1234", "5678", "2020")))
    shm_before = set(SHM.iterdir()) if SHM.is_dir() else set()
    killer = RunKiller(tmp_path / "stream", _after_the_second_evaluation)
    killer.start()
    try:
        # A prompt the dead instance was handed but never heard of comes back when its lease runs out.
        run = run_recipe(tmp_path, "stream", 1, "stream", "rollout.partial=true", "algorithm.kl_coef=0",
                         f"data.val_path={val}", "data.apply_chat_template=false", "workflow.eval_every=2",
                         "workflow.eval_before_train=true", "workflow.eval_k=2", "workflow.eval_samples=1",
                         "transfer_queue.row_lease_s=30", "transfer_queue.put_lease_s=30",
                         "workflow.rollout_spares=1", *LONGTAIL, sizes=[*SMALL, f"workflow.steps={STEPS}"])
    finally:
        killer.stop = True
        killer.join(10)
    assert killer.killed, "the run ended before the kill"
    check_stream(run, 1, STEPS, PROMPTS, GROUP)
    metrics = records(run)
    # The spare's promotion, recorded in the summary, restarts.jsonl and the metrics, and printed. The spare that
    # refills the pool may still be building its engine when the run ends (recorded then; test_spare waits for it).
    promoted = [e for e in run["service_restarts"] if e["service"] == "rollout"]
    assert [(e["worker"], e["restart"], e["how"]) for e in promoted] == [(0, 1, "spare promoted")], promoted
    restart = promoted[0]
    assert restart["recovered_at"] is not None and restart["resumed_at_step"] < STEPS, restart
    assert {e["service"] for e in run["service_restarts"]} <= {"rollout", "rollout spare"}, run["service_restarts"]
    layout = json.loads((run["_out"] / "layout.json").read_text())  # the run's last: the spare in slot 0
    assert [row["pid"] for row in layout["rollout"]] != [killer.killed[0]], layout["rollout"]
    # How many prompts the dead engine held at the instant of the SIGKILL depends on timing (none while it waits
    # at the staleness bound for a slow trainer step); that they go back is checked on the fake engines
    # (test_restart_stream). Here exactly-once above says none was lost.
    assert restart["released_rows"] is not None, restart
    lines = [json.loads(line) for line in (run["_out"] / "restarts.jsonl").read_text().splitlines()]
    assert lines == run["service_restarts"]
    assert sum(m.get("supervisor/restarts", 0.0) for m in metrics) == 1.0
    assert "rollout instance 0 is replaced by a spare" in run["_stdout"], run["_stdout"][-3000:]
    # The rows the dead instance put in steps it had not reported are in no report (docs/fault_tolerance.md): the
    # step the spare went on from, and the next (max_staleness 1), may count fewer rollout rows.
    unreported = {restart["resumed_at_step"] + d for d in (0, 1)}
    for m in metrics:
        assert m.get("staleness/token_lag_max", 0) <= 1
        assert m.get("rollout/rows") == PROMPTS * GROUP or (m["step"] in unreported
                                                            and m.get("rollout/rows", 0) < PROMPTS * GROUP), m
        assert m["actor/rows"] == PROMPTS * GROUP  # no validation response was trained
    evals = [m for m in metrics if "eval/version" in m]
    assert [m["eval/version"] for m in evals[:2]] in ([0, 2], [0, 3]) and evals[0]["step"] == 0
    # After the kill the spare evaluates at version 4 or later, never version 0 again, and never a version
    # whose evaluation the dead one reported (the board's record): the versions only grow.
    versions = [m["eval/version"] for m in evals]
    assert all(v >= 4 for v in versions[2:]) and all(a < b for a, b in zip(versions, versions[1:])), evals
    assert all(m["eval/prompts"] == 3 for m in evals)
    assert sorted(p.name for p in (run["_out"] / "eval_samples").iterdir()) == [
        f"step_{m['step']:06d}.jsonl" for m in evals]
    assert run["fresh_logprob_gap_max"] < 1e-4  # vLLM and Megatron agree on the tokens of the trained version
    # Partial rollout on vLLM: newer weights were swapped in under responses in flight, so some step trained rows
    # whose tokens span two versions, and Megatron's logprobs equal vLLM's on the tokens of the version trained
    # that such rows made after the swap (the gap above covers them).
    assert sum(m.get("rollout/weight_swaps", 0) for m in metrics) >= 1
    assert any(m["staleness/token_lag_min"] < m["staleness/token_lag_max"] for m in metrics)
    assert sum(m.get("check/fresh_spanning_tokens", 0) for m in metrics) > 0
    assert max(m["ray/object_store_bytes"] for m in metrics) < 100_000
    # Nothing of the killed instance survives it: no process (vLLM's, at TP > 1 or out of process), no segment.
    assert not [pid for pid in killer.killed if psutil.pid_exists(pid)], killer.killed
    # Multiprocessing's semaphores (sem.mp-*) name no owner, and those of another test running beside this one
    # (pytest-xdist) can be waiting in /dev/shm for their resource tracker: the session-end check
    # (tests/conftest.py) fails the suite if one is left for good.
    left = [name for name in left_in_shm({p.name for p in shm_before}) if not name.startswith("sem.mp-")]
    assert not left, left
